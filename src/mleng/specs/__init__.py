"""mleng.specs"""
