"""compushare.app"""
