"""mleng.measure"""
