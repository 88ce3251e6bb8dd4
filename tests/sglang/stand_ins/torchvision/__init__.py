"""An import-only stand-in for torchvision, for `make test-sglang` only.

Why: SGLang 0.5.23 imports torchvision at module level in multimodal files
that its memory-pool modules reach through ``sglang.srt.configs``
(``multimodal/internvl_utils.py`` via ``configs/nano_nemotron_vl.py``, and
``configs/deepseek_ocr.py``), and transformers then imports
``torchvision.io`` / ``torchvision.transforms`` in ``image_utils.py``. The
torchvision wheels a resolver finds are CUDA builds whose C++ operators do
not load against the CPU torch 2.13.0 this project tests with (``operator
torchvision::nms does not exist`` at import); the storage, host-pool and
controller code tested here never calls torchvision.

What stands in: ``torchvision`` and every submodule of it that is imported
(``torchvision.transforms``, ``torchvision.transforms.functional``,
``torchvision.io``, ...), made on demand. Any name looked up in them is a
`Placeholder`; attributes of a placeholder are placeholders
(``InterpolationMode.BICUBIC``), and CALLING one raises `RuntimeError`, so
no image code can silently run on a stand-in. tests/sglang/test_sglang_storage.py puts
the directory above this one on ``sys.path``; nothing outside the SGLang
tests sees it.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import types
from collections.abc import Sequence
from typing import Any

__version__ = "0.0.0+kvtier.stand.in"
__path__: list[str] = []  # a package: submodules come from the finder below


class Placeholder:
    """A name from torchvision that exists so that imports succeed; calling it raises."""

    def __init__(self, name: str) -> None:
        self._name = name

    def __getattr__(self, attr: str) -> Placeholder:
        if attr.startswith("__"):
            raise AttributeError(attr)
        return Placeholder(f"{self._name}.{attr}")

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(
            f"{self._name} was called, but torchvision is an import-only stand-in in kvtier's SGLang tests "
            f"(tests/sglang/stand_ins/torchvision): install a torchvision build that matches torch to use it"
        )

    def __repr__(self) -> str:
        return f"<torchvision stand-in {self._name}>"


def _placeholder_getattr(module: str) -> Any:
    def __getattr__(name: str) -> Placeholder:
        if name.startswith("__"):
            raise AttributeError(name)
        return Placeholder(f"{module}.{name}")

    return __getattr__


class _StandInModules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Makes ``torchvision.<anything>`` importable as a module of placeholders."""

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: types.ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if not fullname.startswith("torchvision."):
            return None
        return importlib.machinery.ModuleSpec(fullname, self, is_package=True)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType | None:
        return None

    def exec_module(self, module: types.ModuleType) -> None:
        module.__path__ = []
        module.__getattr__ = _placeholder_getattr(module.__name__)  # type: ignore[method-assign]


__getattr__ = _placeholder_getattr("torchvision")
if not any(isinstance(f, _StandInModules) for f in sys.meta_path):
    sys.meta_path.insert(0, _StandInModules())
