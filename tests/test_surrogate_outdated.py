"""A surrogate refuses a changed model: ``SurrogateOutdated`` at the start of its backward.

Between ``est.surrogate(...)`` and ``sur.loss.backward()`` the model may change; the
backward would then disagree with it (``exact:checkpoint=true`` recomputes its steps with
the model as it is now: new weights or another dropout mode gave a silently mixed
gradient or torch's raw ``CheckpointError``; the other estimators' graphs hold the old
tensors). Checked, for every registered estimator (parametrized over the registry, so a new
one is covered without a change here) and both checkpointed forms, terminal and stepwise:

* each kind of change raises :class:`gradest.SurrogateOutdated` (a ``GradestError`` and a
  ``RuntimeError``, one line) naming what changed, before any ``.grad`` is written: a
  parameter replaced (by one of equal values) or modified in place (frozen ones too), a
  buffer replaced or modified in place, a submodule replaced, a module switched between
  train and eval; which parameter, buffer or module is drawn by hypothesis;
* what training code does between the two that is not a change of the model (zeroing
  gradients, evaluating under ``no_grad``, an eval/train round trip, ``state_dict`` and a
  deep copy, a second surrogate backpropagated before or after the first: gradient
  accumulation) raises nothing, and the gradients are those of the same estimator without
  the check, exactly (float64), also on a model whose forward updates a buffer of its own;
* FSDP2 (one gloo rank in a forked process): its swaps of sharded and unsharded
  parameters are not a change (two surrogates accumulated before their backwards), and an
  optimizer step between surrogate and backward is one;
* the fingerprint names every slot as ``named_modules`` / ``named_parameters`` /
  ``named_buffers`` do, on random module trees.
"""

from __future__ import annotations

import copy
import json
import re
from contextlib import contextmanager
from pathlib import Path
from unittest import mock

import pytest
import torch
import torch.multiprocessing as mp
from _hypothesis_profiles import examples
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

import gradest
from gradest.errors import GradestError
from gradest.model_state import ModelState, RecordedState
from gradest.protocol import supports
from gradest.registry import available_estimators
from gradest.testing.problems import random_stepwise_objective, seeded_normal

DIM, HIDDEN, BATCH, STEPS = 3, 8, 2, 5
FLOW = gradest.RectifiedFlow(steps=STEPS)
TERMINAL = gradest.TerminalObjective(lambda z: torch.sin(z).pow(2).sum() + 0.1 * z.pow(2).sum())
STEPWISE = random_stepwise_objective(STEPS, (BATCH, DIM))
NOISE = seeded_normal((BATCH, DIM), 10)


def registered_specs() -> list[str]:
    """Every registered estimator with its defaults, and both checkpointed forms."""
    return [*sorted(available_estimators()), "exact:checkpoint=true", "jagg:checkpoint=true"]


CASES = [
    pytest.param(spec, kind, id=f"{spec}-{kind}")
    for spec in registered_specs()
    for kind in ("terminal", "stepwise")
    if supports(gradest.estimator(spec), kind)
]


class Shifted(nn.Module):
    """``tanh(W x + b + shift)`` with ``shift`` a buffer: a nested buffer and parameters."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(DIM + 1, HIDDEN)
        self.register_buffer("shift", 0.1 * torch.randn(HIDDEN))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.lin(x) + self.shift)


class Probe(nn.Module):
    """A velocity model with dropout (active in training mode), a frozen parameter (a LoRA
    base weight), buffers at two depths and a nested submodule."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            self.block = Shifted()
            self.drop = nn.Dropout(0.25)
            self.out = nn.Linear(HIDDEN, DIM)
            self.offset = nn.Parameter(0.1 * torch.randn(DIM), requires_grad=False)
            self.register_buffer("scale", 1.0 + 0.1 * torch.randn(DIM))
        self.double()

    def forward(self, z: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        h = self.block(torch.cat([z, t[:, None].to(z.dtype)], dim=-1))
        return self.out(self.drop(h)) * self.scale + self.offset


class Counting(Probe):
    """A :class:`Probe` whose forward counts its calls in a buffer of its own (accepted
    input, ``docs/errors.md``): the forward's own change is not the caller's."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__(seed)
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))

    def forward(self, z: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return super().forward(z, t)


def _recorded_path() -> gradest.Trajectory:
    model = Probe(seed=1).eval()
    return gradest.rollout(model, FLOW, seeded_normal((BATCH, DIM), 11))


TRAJECTORY = _recorded_path()


def surrogate(est, model: nn.Module, kind: str, seed: int = 5):
    inputs = {"noise": NOISE} if kind == "terminal" else {"trajectory": TRAJECTORY}
    objective = TERMINAL if kind == "terminal" else STEPWISE
    return est.surrogate(
        model, FLOW, objective, generator=torch.Generator().manual_seed(seed), **inputs
    )


# -- the changes, and the phrase the message must hold for each ---------------------------------

_PROBE = Probe()
PARAMETERS = [name for name, _ in _PROBE.named_parameters()]  # frozen "offset" included
BUFFERS = [name for name, _ in _PROBE.named_buffers()]
SUBMODULES = [name for name, _ in _PROBE.named_modules() if name]
MODULES = ["", *SUBMODULES]  # "" is the model itself
TARGETS = {
    "replace parameter": PARAMETERS,
    "modify parameter in place": PARAMETERS,
    "replace buffer": BUFFERS,
    "modify buffer in place": BUFFERS,
    "replace submodule": SUBMODULES,
    "switch mode": MODULES,
}


def _owner(model: nn.Module, name: str) -> tuple[nn.Module, str]:
    path, _, leaf = name.rpartition(".")
    return (model.get_submodule(path) if path else model), leaf


def _label(kind: str, name: str) -> str:
    if kind == "module":
        return "the model" if not name else f"module '{name}'"
    return f"{kind} '{name}'"


def apply_change(model: nn.Module, change: str, target: str) -> str:
    """Change ``target`` of ``model``; returns the phrase the error must contain."""
    if change == "replace parameter":
        owner, leaf = _owner(model, target)
        old = getattr(owner, leaf)
        # Equal values: the object is what the graph holds, so a new one is a change.
        setattr(owner, leaf, nn.Parameter(old.detach().clone(), requires_grad=old.requires_grad))
        return f"{_label('parameter', target)} was replaced"
    if change == "modify parameter in place":
        with torch.no_grad():
            model.get_parameter(target).mul_(1.01)
        return f"{_label('parameter', target)} was modified in place (an optimizer.step()?)"
    if change == "replace buffer":
        owner, leaf = _owner(model, target)
        setattr(owner, leaf, model.get_buffer(target).clone())
        return f"{_label('buffer', target)} was replaced"
    if change == "modify buffer in place":
        model.get_buffer(target).mul_(1.01)
        return f"{_label('buffer', target)} was modified in place"
    if change == "replace submodule":
        owner, leaf = _owner(model, target)
        setattr(owner, leaf, copy.deepcopy(getattr(owner, leaf)))
        return f"{_label('module', target)} was replaced"
    assert change == "switch mode"
    module = model.get_submodule(target)
    before = "train" if module.training else "eval"
    module.train(not module.training)
    after = "train" if module.training else "eval"
    return f"{_label('module', target)} switched {before} -> {after}"


def check_refused(spec: str, kind: str, change: str, target: str, model: nn.Module) -> None:
    est = gradest.estimator(spec)
    sur = surrogate(est, model, kind)
    phrase = apply_change(model, change, target)
    with pytest.raises(gradest.SurrogateOutdated) as caught:
        sur.loss.backward()
    error = caught.value
    assert isinstance(error, GradestError) and isinstance(error, RuntimeError)
    message = str(error)
    assert "\n" not in message
    assert phrase in message, message
    # The estimator whose loss it is (auto's: the one it chose).
    assert "(estimator " in message and "call est.surrogate(...) again" in message
    # Raised before any gradient was computed (or any step recomputed).
    assert all(p.grad is None for p in model.parameters())
    # A surrogate of the changed model is fine.
    surrogate(est, model, kind).loss.backward()
    assert any(p.grad is not None for p in model.parameters())


# One target per kind for the deterministic test (the property below draws them): a nested
# trainable weight, the frozen parameter, a nested buffer, a submodule, model.eval().
EXAMPLE_TARGETS = {
    "replace parameter": "block.lin.weight",
    "modify parameter in place": "offset",
    "replace buffer": "block.shift",
    "modify buffer in place": "scale",
    "replace submodule": "out",
    "switch mode": "",
}


@pytest.mark.parametrize("change", sorted(TARGETS))
@pytest.mark.parametrize(("spec", "kind"), CASES)
def test_each_kind_of_change_is_refused_naming_it(spec, kind, change):
    check_refused(spec, kind, change, EXAMPLE_TARGETS[change], Probe())


def test_a_dropout_mode_switch_is_refused_before_the_checkpoint_recomputes():
    """The hostile tester's case: torch's raw CheckpointError (the recomputation saw no
    dropout), now one line naming the module."""
    model = Probe()
    sur = surrogate(gradest.estimator("exact:checkpoint=true"), model, "terminal")
    model.drop.eval()
    with pytest.raises(gradest.SurrogateOutdated, match="module 'drop' switched train -> eval"):
        sur.loss.backward()


@pytest.mark.parametrize(("spec", "kind"), CASES)
@examples(ci=6)
@given(data=st.data())
def test_any_change_of_any_slot_is_refused_naming_it(spec, kind, data):
    change = data.draw(st.sampled_from(sorted(TARGETS)), label="change")
    target = data.draw(st.sampled_from(TARGETS[change]), label="target")
    check_refused(spec, kind, change, target, Probe(seed=data.draw(st.integers(0, 3))))


def test_an_optimizer_step_names_every_updated_parameter_it_can():
    model = Probe()
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    est = gradest.estimator("exact:checkpoint=true")
    surrogate(est, model, "terminal").loss.backward()
    stale = surrogate(est, model, "terminal")
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    with pytest.raises(gradest.SurrogateOutdated) as caught:
        stale.loss.backward()
    message = str(caught.value)
    assert "parameter 'block.lin.weight' was modified in place (an optimizer.step()?)" in message
    assert re.search(r"and 1 more;", message), message  # 4 updated, 3 spelled out
    assert "offset" not in message  # frozen: the optimizer did not touch it


# -- what is not a change: the gradient is the unchecked estimator's ------------------------------

BENIGN = (
    "zero_grad",
    "zero_grad to zeros",
    "no_grad forward",
    "eval and back to train",
    "state_dict and deepcopy",
    "second surrogate, its backward later",
    "second surrogate and its backward",
)


@contextmanager
def unchecked():
    """The surrogate without the check (what the estimators did before it)."""
    with mock.patch.object(RecordedState, "check", lambda self, now, estimator: None):
        yield


def train_step(spec: str, kind: str, make: type[Probe], actions: list[str]) -> list[torch.Tensor]:
    # The forwards outside the estimator's generator (the no_grad ones here, auto's probes)
    # draw dropout masks from torch's default generator: the same ones in both runs.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return _train_step(spec, kind, make, actions)


def _train_step(spec: str, kind: str, make: type[Probe], actions: list[str]) -> list[torch.Tensor]:
    model = make()
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    est = gradest.estimator(spec)
    sur = surrogate(est, model, kind)
    later = []
    for action in actions:
        if action == "zero_grad":
            optimizer.zero_grad(set_to_none=True)
        elif action == "zero_grad to zeros":
            optimizer.zero_grad(set_to_none=False)
        elif action == "no_grad forward":
            with torch.no_grad():
                model(NOISE, torch.full((BATCH,), 0.5, dtype=torch.float64))
        elif action == "eval and back to train":
            model.eval()
            with torch.no_grad():
                model(NOISE, torch.full((BATCH,), 0.5, dtype=torch.float64))
            model.train()
        elif action == "state_dict and deepcopy":
            model.state_dict()
            copy.deepcopy(model)
        elif action == "second surrogate, its backward later":
            later.append(surrogate(est, model, kind, seed=6))
        else:
            surrogate(est, model, kind, seed=7).loss.backward()
    sur.loss.backward()
    for other in later:
        other.loss.backward()
    return [p.grad for p in model.parameters() if p.requires_grad]


@pytest.mark.parametrize(("spec", "kind"), CASES)
@examples(ci=4)
@given(actions=st.lists(st.sampled_from(BENIGN), max_size=3), counting=st.booleans())
def test_what_is_not_a_change_gives_the_unchecked_gradient(spec, kind, actions, counting):
    make = Counting if counting else Probe
    got = train_step(spec, kind, make, actions)
    with unchecked():
        want = train_step(spec, kind, make, actions)
    for g, w in zip(got, want, strict=True):
        assert (g is None) == (w is None)
        assert g is None or torch.equal(g, w)


@pytest.mark.parametrize(("spec", "kind"), CASES)
def test_gradient_accumulation_over_surrogates_before_one_step(spec, kind):
    """Two surrogates, then both backwards (a forward-updated buffer moved in between)."""
    actions = ["second surrogate, its backward later", "no_grad forward"]
    got = train_step(spec, kind, Counting, actions)
    with unchecked():
        want = train_step(spec, kind, Counting, actions)
    assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))


# -- FSDP2: its parameter swaps are not a change; an optimizer step is ----------------------------


def _fsdp_worker(rank: int, init_file: str, out_file: str) -> None:
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=1)
    out: dict[str, object] = {}
    try:
        for spec in ("exact", "exact:checkpoint=true", "sdo"):
            est = gradest.estimator(spec)
            for inner in (False, True):
                name = f"{spec} {'inner+root' if inner else 'root'}"
                model, reference = Probe().eval(), Probe().eval()
                if inner:
                    fully_shard(model.block)
                fully_shard(model)
                optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
                # Two surrogates before their backwards: FSDP2 registers the root's
                # unsharded parameters in the first forward and the sharded ones after
                # the first backward.
                first, second = surrogate(est, model, "terminal"), surrogate(est, model, "terminal")
                first.loss.backward()
                second.loss.backward()
                for _ in range(2):
                    surrogate(est, reference, "terminal").loss.backward()
                out[f"{name} accumulated"] = max(
                    float((p.grad.full_tensor() - q.grad).abs().max())
                    for p, q in zip(model.parameters(), reference.parameters(), strict=True)
                    if q.grad is not None
                )
                stale = surrogate(est, model, "terminal")
                optimizer.step()
                try:
                    stale.loss.backward()
                    out[f"{name} stepped"] = "no error"
                except gradest.SurrogateOutdated as err:
                    out[f"{name} stepped"] = str(err)
    finally:
        dist.destroy_process_group()
    Path(out_file).write_text(json.dumps(out))


@pytest.mark.slow
def test_fsdp2_parameter_swaps_are_not_a_change_and_an_optimizer_step_is(tmp_path):
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_gloo_available()):
        pytest.skip("torch.distributed with the gloo backend is not available")
    # fork: the rank inherits this process's imports (see tests/test_distributed.py).
    start = "fork" if "fork" in mp.get_all_start_methods() else "spawn"
    out = tmp_path / "out.json"
    mp.start_processes(
        _fsdp_worker, args=(str(tmp_path / "init"), str(out)), nprocs=1, start_method=start
    )
    results = json.loads(out.read_text())
    assert len(results) == 12
    for name, value in results.items():
        if name.endswith("accumulated"):
            assert value <= 1e-12, (name, value)
        else:
            assert "was modified in place (an optimizer.step()?)" in value, (name, value)


# -- the fingerprint's names ----------------------------------------------------------------------


@st.composite
def module_trees(draw, depth: int = 0) -> nn.Module:
    module = nn.Module()
    for i in range(draw(st.integers(0, 2))):
        module.register_parameter(f"p{i}", nn.Parameter(torch.zeros(1)))
    if draw(st.booleans()):
        module.register_buffer("b", torch.zeros(1))
    if draw(st.booleans()):
        module.register_buffer("none", None)
    if depth < 3:
        children = draw(st.lists(module_trees(depth=depth + 1), max_size=3))
        for i, child in enumerate(children):
            module.add_module(f"m{i}", child)
        if children and draw(st.booleans()):
            module.add_module("again", children[0])  # one submodule under two names
        if draw(st.booleans()):
            module.add_module("gone", None)  # a slot without a module
        if draw(st.booleans()):
            module.add_module("empty", nn.Sequential())  # falsy (len 0), still a module
    return module


@examples(ci=20)
@given(model=module_trees())
def test_the_fingerprint_names_every_slot_as_torch_does(model):
    entries = ModelState.of(model).entries()
    want = [("module", name) for name, _ in model.named_modules(remove_duplicate=False)]
    assert [key for key in entries if key[0] == "module"] == want
    params = {name for name, _ in model.named_parameters(remove_duplicate=False)}
    assert {name for kind, name in entries if kind == "parameter"} == params
    buffers = {name for name, _ in model.named_buffers(remove_duplicate=False)}
    # named_buffers skips None buffers; the fingerprint keeps them (set one: a change).
    assert buffers <= {name for kind, name in entries if kind == "buffer"}
    assert ModelState.of(model).same_as(ModelState.of(model))
