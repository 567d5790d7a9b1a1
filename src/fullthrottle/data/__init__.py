"""The data plane: where inputs (paths, URLs, bytes) become crops, in this process or in CPU and GPU decoder processes."""
