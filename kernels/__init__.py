"""prescient.kernels"""
