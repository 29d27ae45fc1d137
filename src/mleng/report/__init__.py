"""mleng.report"""
