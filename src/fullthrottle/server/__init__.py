"""The HTTP front end: FastAPI app, request guards, options, services and the text routes."""
