"""Image classification: the five-stage pipeline, its compute stage and models."""
