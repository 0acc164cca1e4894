from torchvision import absent_module

__getattr__ = absent_module(__name__)
