"""prescient.runtime"""
