"""Stand-in for PyTorch, used only by nixl-connect's interop tests.

`dynamo.nixl_connect` imports torch at import time but, on the paths the interop tests take
(bytes/bytearray and numpy descriptors), only uses it for `isinstance(x, torch.Tensor)` checks.
Installing the real package costs several GB of CUDA wheels on CPU-only CI, so the tests put this
folder first on PYTHONPATH instead. The Dynamo module itself is never modified.
"""


class Tensor:  # noqa: D101 - nothing is ever an instance of this
    pass


class _Cuda:
    @staticmethod
    def is_available() -> bool:
        return False


cuda = _Cuda()
