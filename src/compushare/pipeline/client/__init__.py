"""compushare.pipeline.client"""
