"""A stand-in for torchvision, for SGLang's import on the CPU (scripts/bootstrap_sglang installs it).

SGLang imports torchvision at start for its image models only; PyPI's torchvision is built for
CUDA and does not load beside the CPU build of torch. Every name here is an object that can be
imported, subclassed or passed around, and that raises a clear error when it is used."""


class Absent:
    def __init__(self, name: str):
        self._name = name

    def __getattr__(self, attr: str) -> "Absent":
        if attr.startswith("__"):
            raise AttributeError(attr)
        return Absent(f"{self._name}.{attr}")

    def __call__(self, *args, **kwargs):
        raise RuntimeError(f"{self._name}: torchvision is a stand-in here (kvstore's SGLang test venv); "
                           "install the real torchvision to use image models")

    def __mro_entries__(self, bases):
        return (object,)


def absent_module(name: str):
    """The module-level __getattr__ of a stand-in module."""
    def getattr_(attr: str) -> Absent:
        if attr.startswith("__"):
            raise AttributeError(attr)
        return Absent(f"{name}.{attr}")
    return getattr_


__version__ = "0.0.0"
__getattr__ = absent_module(__name__)
