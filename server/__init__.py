"""prescient.server"""
