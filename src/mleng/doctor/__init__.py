"""mleng.doctor"""
