"""mleng.machine"""
