"""mleng.handbook"""
