"""Policy base class and the per-family registries.

Every policy family (`Partitioner`, `EdgeScorer`, `Pruner`, `MessagePasser`,
`Scheduler`, `Relevance`) derives from `Policy`. A family keeps a registry that maps a
short name to an implementation, so that configurations can name policies:

```python
from dataclasses import dataclass
from lightkv.policies import EdgeScorer

@EdgeScorer.register("my_divergence")
@dataclass
class MyDivergence(EdgeScorer):
    temperature: float = 1.0

    def divergence(self, src, dst):
        ...
```

Third-party packages can also expose policies through the ``lightkv.policies`` entry-point
group (``my_divergence = "package.module:MyDivergence"``, the entry-point name equal to the
registered name); each is loaded on its own the first time a name is looked up and not
found (see `lightkv.policies.plugins`).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any, ClassVar, TypeVar, cast

from .plugins import ENTRY_POINT_GROUP, EntryPointStatus, PluginError, load_entry_points

__all__ = ["Policy", "ENTRY_POINT_GROUP", "removed_names", "removed_field_message"]

P = TypeVar("P", bound=type)


T = TypeVar("T", bound=type)

_PolicyT = TypeVar("_PolicyT", bound="Policy")


def removed_names(**old_to_new: str) -> Callable[[T], T]:
    """Class decorator (put it above ``@dataclass``): refuse field names that were renamed.

    lightkv has no release, so renamed fields keep no alias (an alias that silently lost to
    or won over its new name was a wrong configuration nobody saw). Instead
    ``@removed_names(ratios="removal_ratios")`` makes ``Cls(ratios=...)`` raise a one-line
    `TypeError` naming the new field, and the mapping is kept as ``removed_fields``
    (inherited and extended by subclasses) so the config layer refuses the old YAML keys
    with the same message.
    """

    def deco(cls: T) -> T:
        mapping = {**getattr(cls, "removed_fields", {}), **old_to_new}
        init = cls.__init__  # type: ignore[misc]  # the class's own, wrapped below

        @functools.wraps(init)
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            message = removed_field_message(cls, kwargs)
            if message is not None:
                raise TypeError(message)
            init(self, *args, **kwargs)

        cls.__init__ = __init__  # type: ignore[misc]
        cls.removed_fields = mapping  # type: ignore[attr-defined]
        return cls

    return deco


def removed_field_message(cls: type, params: Any, where: str | None = None) -> str | None:
    """The one-line message for the first removed field name of ``cls`` (see
    `removed_names`) among ``params``' keys, or None; ``where`` prefixes it (e.g. the YAML
    location, default the class name)."""
    mapping = getattr(cls, "removed_fields", {})
    for old in params:
        if old in mapping:
            return f"{where or cls.__name__}: {old!r} was renamed; use {mapping[old]!r}"
    return None


class Policy:
    """Base of all policies: a small dataclass whose fields are its hyper-parameters.

    Subclasses that start a family set ``family`` (the family's one name: its key in
    pipeline files and error messages) and get their own registry.
    """

    family: ClassVar[str] = "policy"
    name: ClassVar[str] = ""
    removed_fields: ClassVar[dict[str, str]] = {}
    """Old field name -> its new name (`removed_names`); empty where nothing was renamed."""
    _registry: ClassVar[dict[str, type[Policy]]]
    _entry_points: ClassVar[dict[str, EntryPointStatus]] = {}
    """Entry points tried so far in this process (shared by every family)."""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "family" in cls.__dict__:  # a new family: a fresh registry
            cls._registry = {}

    @classmethod
    def register(cls, name: str) -> Callable[[P], P]:
        """Class decorator: register an implementation of this family under ``name``.

        Raises:
            ValueError: the name is not a non-empty string, or is already taken by another
                class.
            TypeError: the class is not a subclass of this family (the family's own base
                class included: registering it would rename the family).
        """
        if not isinstance(name, str) or not name.strip():
            raise ValueError(f"a {cls.family} is registered under a non-empty name, got {name!r}")

        def deco(impl: P) -> P:
            if not (isinstance(impl, type) and issubclass(impl, cls)):
                raise TypeError(
                    f"{impl!r} must subclass {cls.__name__} to be registered as a {cls.family}"
                )
            if "family" in vars(impl):  # the family's base: registering it would rename the family
                raise TypeError(
                    f"register a subclass of {impl.__name__}, not the family's base class itself"
                )
            existing = cls._registry.get(name)
            if existing is not None and existing.__qualname__ != impl.__qualname__:
                raise ValueError(
                    f"{cls.family} name {name!r} is already registered by {existing.__qualname__}"
                )
            impl.name = name
            cls._registry[name] = impl
            return impl

        return deco

    @classmethod
    def registered(cls: type[_PolicyT]) -> dict[str, type[_PolicyT]]:
        """Name -> class for every registered implementation of this family (every
        installed plugin's entry point is loaded first)."""
        cls._load_entry_points()
        # `register` admits only subclasses of the family into its registry
        return cast("dict[str, type[_PolicyT]]", dict(sorted(cls._registry.items())))

    @classmethod
    def loaded(cls: type[_PolicyT]) -> dict[str, type[_PolicyT]]:
        """Name -> class for the implementations registered so far, without loading any
        plugin: lightkv's own, and plugins already loaded (`lookup` loads one on demand).
        What a check of built-in names uses, so ``import lightkv.presets`` imports no
        plugin."""
        return cast("dict[str, type[_PolicyT]]", dict(sorted(cls._registry.items())))

    @classmethod
    def lookup(cls: type[_PolicyT], name: str) -> type[_PolicyT]:
        """The class registered under ``name``.

        Raises:
            ValueError: no such name; the message lists the registered names and the plugins
                that failed to load. `PluginError` (a ValueError) when ``name`` is a plugin's
                entry point that failed to load.
        """
        if name not in cls._registry:
            cls._load_entry_points(first=name, done=lambda: name in cls._registry)
        if name in cls._registry:
            return cast("type[_PolicyT]", cls._registry[name])  # a subclass (see `register`)
        failed = [s for s in cls._entry_points.values() if s.error is not None]
        own = [s for s in failed if s.name == name]
        if own:
            raise PluginError(
                f"{cls.family} {name!r} comes from a plugin that failed to load: "
                f"{own[0].describe()}"
            )
        known = ", ".join(sorted(cls._registry)) or "(none)"
        message = f"unknown {cls.family} {name!r}; registered {cls.family}s: {known}"
        if failed:
            message += "; plugins that failed to load: " + "; ".join(s.describe() for s in failed)
        raise ValueError(message)

    @classmethod
    def create(cls: type[_PolicyT], name: str, **params: Any) -> _PolicyT:
        """Instantiate the implementation registered under ``name`` with ``params``.

        Raises:
            ValueError: unknown name, or a parameter the policy does not have.
        """
        impl = cls.lookup(name)
        message = removed_field_message(impl, params, f"{cls.family} {name!r}")
        if message is not None:
            raise ValueError(message)
        if dataclasses.is_dataclass(impl):
            allowed = {f.name for f in dataclasses.fields(impl) if f.init}
            bad = sorted(set(params) - allowed)
            if bad:
                raise ValueError(
                    f"{cls.family} {name!r} has no parameter(s) {', '.join(bad)}; "
                    f"its parameters are: {', '.join(sorted(allowed)) or '(none)'}"
                )
        return impl(**params)

    def params(self) -> dict[str, Any]:
        """The policy's hyper-parameters (its dataclass fields) as a plain dict."""
        if dataclasses.is_dataclass(self):
            return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.init}
        return {}

    @property
    def needs(self) -> frozenset[str]:
        """Names of the `lightkv.policies.StageInputs` features this policy reads beyond the
        hidden states and the layout (e.g. ``{"key_states"}``); adapters compute only these."""
        return frozenset()

    @property
    def tower_layers(self) -> tuple[int, ...]:
        """0-based vision tower layers whose attention this policy reads from
        `lightkv.policies.StageInputs.tower` (VScan's local scan: a shallow layer); adapters
        that expose the tower read exactly these."""
        return ()

    @classmethod
    def _load_entry_points(
        cls, first: str | None = None, done: Callable[[], bool] = lambda: False
    ) -> None:
        load_entry_points(Policy._entry_points, Policy, first, done)
