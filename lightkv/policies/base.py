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
import warnings
from typing import Any, Callable, ClassVar, TypeVar

from .plugins import ENTRY_POINT_GROUP, EntryPointStatus, PluginError, load_entry_points

__all__ = ["Policy", "ENTRY_POINT_GROUP", "renamed"]

P = TypeVar("P", bound=type)


T = TypeVar("T", bound=type)


def renamed(**old_to_new: str) -> Callable[[T], T]:
    """Class decorator (put it above ``@dataclass``): keep accepting renamed fields.

    ``@renamed(ratios="removal_ratios")`` makes ``Cls(ratios=...)`` (and
    ``dataclasses.replace(obj, ratios=...)``) set ``removal_ratios`` with a
    `DeprecationWarning` that names the new field, and ``obj.ratios`` read it. The mapping
    is kept as ``renamed_fields`` (inherited and extended by subclasses), so the config
    layer accepts the old YAML keys the same way. Where both names are given, the old one
    wins: that is what `dataclasses.replace` with an old name means.
    """

    def deco(cls: T) -> T:
        mapping = {**getattr(cls, "renamed_fields", {}), **old_to_new}
        init = cls.__init__

        @functools.wraps(init)
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            init(self, *args, **rename_fields(cls, kwargs, stacklevel=3))

        cls.__init__ = __init__  # type: ignore[misc]
        cls.renamed_fields = mapping  # type: ignore[attr-defined]
        for old, new in old_to_new.items():
            setattr(cls, old, property(lambda self, new=new: getattr(self, new), doc=f"Deprecated name of `{new}`."))
        return cls

    return deco


def rename_fields(cls: type, params: dict[str, Any], where: str | None = None, stacklevel: int = 2) -> dict[str, Any]:
    """``params`` with every deprecated field name of ``cls`` (see `renamed`) replaced by
    its new name, warning once per old name; ``where`` prefixes the warning (e.g. the
    YAML location)."""
    mapping = getattr(cls, "renamed_fields", {})
    if not mapping or not any(k in mapping for k in params):
        return params
    out = dict(params)
    for old, new in mapping.items():
        if old in out:
            label = where or f"{cls.__name__}"
            warnings.warn(f"{label}: {old!r} is deprecated, use {new!r}", DeprecationWarning, stacklevel=stacklevel + 1)
            out[new] = out.pop(old)
    return out


class Policy:
    """Base of all policies: a small dataclass whose fields are its hyper-parameters.

    Subclasses that start a family set ``family`` (the family's one name: its key in
    pipeline files and error messages) and get their own registry.
    """

    family: ClassVar[str] = "policy"
    name: ClassVar[str] = ""
    _registry: ClassVar[dict[str, type]]
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
            ValueError: the name is already taken by another class.
            TypeError: the class is not a subclass of this family.
        """

        def deco(impl: P) -> P:
            if not (isinstance(impl, type) and issubclass(impl, cls)):
                raise TypeError(f"{impl!r} must subclass {cls.__name__} to be registered as a {cls.family}")
            existing = cls._registry.get(name)
            if existing is not None and existing.__qualname__ != impl.__qualname__:
                raise ValueError(f"{cls.family} name {name!r} is already registered by {existing.__qualname__}")
            impl.name = name
            cls._registry[name] = impl
            return impl

        return deco

    @classmethod
    def registered(cls) -> dict[str, type]:
        """Name -> class for every registered implementation of this family."""
        cls._load_entry_points()
        return dict(sorted(cls._registry.items()))

    @classmethod
    def lookup(cls, name: str) -> type:
        """The class registered under ``name``.

        Raises:
            ValueError: no such name; the message lists the registered names and the plugins
                that failed to load. `PluginError` (a ValueError) when ``name`` is a plugin's
                entry point that failed to load.
        """
        if name not in cls._registry:
            cls._load_entry_points(first=name, done=lambda: name in cls._registry)
        if name in cls._registry:
            return cls._registry[name]
        failed = [s for s in Policy._entry_points.values() if s.error is not None]
        own = [s for s in failed if s.name == name]
        if own:
            raise PluginError(f"{cls.family} {name!r} comes from a plugin that failed to load: {own[0].describe()}")
        known = ", ".join(sorted(cls._registry)) or "(none)"
        message = f"unknown {cls.family} {name!r}; registered {cls.family}s: {known}"
        if failed:
            message += "; plugins that failed to load: " + "; ".join(s.describe() for s in failed)
        raise ValueError(message)

    @classmethod
    def create(cls, name: str, **params: Any) -> "Policy":
        """Instantiate the implementation registered under ``name`` with ``params``.

        Raises:
            ValueError: unknown name, or a parameter the policy does not have.
        """
        impl = cls.lookup(name)
        params = rename_fields(impl, params, f"{cls.family} {name!r}")
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
        hidden states and the layout (e.g. ``{"keys"}``); adapters compute only these."""
        return frozenset()

    @classmethod
    def _load_entry_points(cls, first: str | None = None, done: Callable[[], bool] = lambda: False) -> None:
        load_entry_points(Policy._entry_points, Policy, first, done)
