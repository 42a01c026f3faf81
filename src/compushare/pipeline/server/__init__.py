"""compushare.pipeline.server"""
