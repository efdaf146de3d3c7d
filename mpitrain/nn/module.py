"""``Module``: a tree of layers that owns parameters and buffers."""

from __future__ import annotations

from collections import OrderedDict

import numpy as np

from mpitrain.tensor import Parameter


class Module:
    """Base class of layers and models. Assigning a :class:`~mpitrain.tensor.Parameter` or a
    ``Module`` to an attribute registers it, :meth:`register_buffer` a non-trained array
    (batch-norm running statistics). Subclasses implement ``forward``, which a call runs."""

    _call_through = None  # see call_through()

    def __init__(self):
        # set around __setattr__, which needs the registries to exist
        self.__dict__.update(_parameters=OrderedDict(), _modules=OrderedDict(), _buffers=OrderedDict(), training=True)

    def __setattr__(self, name, value):
        if "_parameters" not in self.__dict__:
            raise RuntimeError(f"{type(self).__name__}.__init__ must call super().__init__() first")
        if name in self._buffers:
            if not isinstance(value, np.ndarray):
                raise TypeError(f"buffer {name!r} must stay an array, got {type(value).__name__}")
            self._buffers[name] = value  # re-assigned in place: the order of entries stays
        else:
            for registry, kind in ((self._parameters, Parameter), (self._modules, Module)):
                if isinstance(value, kind):
                    registry[name] = value  # a name re-assigned keeps its place in the order
                else:
                    registry.pop(name, None)
        object.__setattr__(self, name, value)

    def register_buffer(self, name: str, array: np.ndarray) -> None:
        """Register state that is saved and loaded but not trained (updated in place)."""
        self._buffers[name] = array
        object.__setattr__(self, name, array)

    def forward(self, *args, **kwargs):  # pragma: no cover - interface
        raise NotImplementedError

    def __call__(self, *args, **kwargs):
        if self._call_through is not None:
            return self._call_through(self, *args, **kwargs)
        return self.forward(*args, **kwargs)

    def call_through(self, fn) -> None:
        """Route calls of this module through ``fn(module, *args, **kwargs)``, which
        calls ``module.forward`` itself; None undoes it. A strategy wraps layers this way
        without the model knowing (ZeRO-3 gathers a layer's parameters around its forward)."""
        object.__setattr__(self, "_call_through", fn)

    # ------------------------------------------------------------------ traversal
    def named_modules(self, prefix: str = ""):
        yield prefix, self
        for name, child in self._modules.items():
            yield from child.named_modules(f"{prefix}.{name}" if prefix else name)

    def modules(self):
        return (m for _, m in self.named_modules())

    def children(self):
        return iter(self._modules.values())

    def named_parameters(self, prefix: str = ""):
        """(name, parameter) pairs in registration order; a shared (tied) parameter once, under its first name."""
        seen: set[int] = set()
        for mod_name, mod in self.named_modules(prefix):
            for name, p in mod._parameters.items():
                if id(p) not in seen:
                    seen.add(id(p))
                    yield (f"{mod_name}.{name}" if mod_name else name), p

    def parameters(self) -> list[Parameter]:
        return [p for _, p in self.named_parameters()]

    def named_buffers(self, prefix: str = ""):
        for mod_name, mod in self.named_modules(prefix):
            for name, b in mod._buffers.items():
                yield (f"{mod_name}.{name}" if mod_name else name), b

    def named_layers(self) -> list[tuple[str, "Module"]]:
        """The model as a sequence of named layers (a timeline times each; a pipeline will
        cut between them): the top-level submodules, unless a model says otherwise."""
        return list(self._modules.items())

    def num_parameters(self) -> int:
        return sum(p.size for p in self.parameters())

    # ---------------------------------------------------------------------- state
    def state_dict(self) -> "OrderedDict[str, np.ndarray]":
        """Copies of every parameter and buffer, by dotted name."""
        state = OrderedDict((n, p.data.copy()) for n, p in self.named_parameters())
        state.update((n, np.array(b, copy=True)) for n, b in self.named_buffers())
        return state

    def load_state_dict(self, state: dict, strict: bool = True) -> None:
        """Copy arrays into the existing parameters and buffers (in place, so views
        into flat buffers stay valid). With ``strict``, names must match exactly."""
        targets = OrderedDict((n, p.data) for n, p in self.named_parameters())
        targets.update(self.named_buffers())
        if strict:
            missing = [n for n in targets if n not in state]
            unexpected = [n for n in state if n not in targets]
            if missing or unexpected:
                raise KeyError(f"state dict mismatch: missing {missing}, unexpected {unexpected}")
        for name, target in targets.items():
            if name not in state:
                continue
            value = np.asarray(state[name])
            if value.shape != target.shape:
                raise ValueError(f"{name}: shape {value.shape} in state, {target.shape} in model")
            np.copyto(target, value)

    # ------------------------------------------------------------------ training
    def train(self, mode: bool = True) -> "Module":
        for m in self.modules():
            object.__setattr__(m, "training", mode)
        return self

    def eval(self) -> "Module":
        return self.train(False)

    def zero_grad(self, set_to_none: bool = False) -> None:
        """Zero the gradients in place (views into flat gradient buffers stay), or drop them (``set_to_none``)."""
        for p in self.parameters():
            if set_to_none:
                p.grad = None
            else:
                p.zero_grad()

    def extra_repr(self) -> str:
        return ""

    def __repr__(self) -> str:
        children = "".join(f"\n  ({n}): " + repr(m).replace("\n", "\n  ") for n, m in self._modules.items())
        return f"{type(self).__name__}({self.extra_repr()}{children})"


class ModuleList(Module):
    """A list of modules, registered under their indices."""

    def __init__(self, modules=()):
        super().__init__()
        self._list: list[Module] = []
        for m in modules:
            self.append(m)

    def append(self, module: Module) -> None:
        setattr(self, str(len(self._list)), module)
        self._list.append(module)

    def __getitem__(self, i):
        return self._list[i]

    def __iter__(self):
        return iter(self._list)

    def __len__(self) -> int:
        return len(self._list)


class Sequential(ModuleList):
    """Modules applied one after the other."""

    def __init__(self, *modules: Module):
        super().__init__(modules)

    def forward(self, x):
        for m in self:
            x = m(x)
        return x
