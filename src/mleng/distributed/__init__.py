"""mleng.distributed"""
