"""Implementations chosen by name (``--backend torch``, ``--quantization int4``): one small registry."""

from __future__ import annotations

from collections.abc import Callable
from typing import ClassVar, Generic, Protocol, TypeVar


class Named(Protocol):
    name: ClassVar[str]


T = TypeVar("T", bound=type[Named])


class Declared(Protocol):
    """The option whose values a registry implements (contract/plan/choices.py's ``Option``)."""

    flag: str

    def declares(self, name: str) -> bool: ...

    def declare(self, value: str, help: str) -> None: ...


class Registry(Generic[T]):
    def __init__(self, what: str, option: Declared, also: str = "") -> None:
        self.what = what  # what a name picks ("backend"), for messages
        self.option = option  # the flag's values, declared once (a name registers only if declared there)
        self.also = also  # other accepted names, for messages (", or auto")
        self._classes: dict[str, T] = {}

    def register(self, name: str, help: str = "") -> Callable[[T], T]:
        """Class decorator: selectable as ``name`` (and told its name, as ``cls.name``). ``name`` is one of the
        option's declared values, or, registered from outside the package, declared by ``help``."""
        if help:
            self.option.declare(name, help)
        if not self.option.declares(name):
            raise ValueError(f"{self.what} {name!r} is not a value of {self.option.flag} (contract/plan/choices.py)")

        def wrap(cls: T) -> T:
            cls.name = name
            self._classes[name] = cls
            return cls

        return wrap

    def __contains__(self, name: str) -> bool:
        return name in self._classes

    def get(self, name: str) -> T:
        try:
            return self._classes[name]
        except KeyError:
            raise ValueError(
                f"unknown {self.what} {name!r} (available: {', '.join(self.names())}{self.also})"
            ) from None

    def names(self) -> list[str]:
        return sorted(self._classes)
