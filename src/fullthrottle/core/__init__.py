"""The runtime core every workload uses: batching, configuration, environment, errors, CUDA graphs, kernels, the stage report, GPU monitoring, MPS."""
