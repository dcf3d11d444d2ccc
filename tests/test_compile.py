"""Every built-in estimator works with a ``torch.compile``'d model (issue 22, item 6).

The model is compiled both ways users do it: wrapped, ``torch.compile(model)`` (an
``OptimizedModule``, whose parameter names start with ``_orig_mod.``), and in place,
``model.compile()``. For every built-in estimator (and the checkpoint/debias variants),
terminal and stepwise objectives where it has them, ``estimate`` with either engine and
``surrogate(...).loss.backward()`` give the eager model's gradients, keyed by the names
``model.named_parameters()`` gives for the model passed.

That the compiled code really ran is checked, not assumed. A compiled model that
silently falls back to eager would pass any equality test, and that is what torch does
after a ``torch.func`` transform reached it (PyTorch issue 128711: the module's code is
marked "skip" for the rest of the process). So:

* the models are compiled with ``fullgraph=True`` and the recompile limit raises instead
  of falling back (``fail_on_recompile_limit_hit``): a graph break or a runaway recompile
  fails the test;
* the model counts the forwards that ran its Python code (``torch.compiler.is_compiling()``
  is False there, and a constant True while Dynamo traces, so compiled graphs count
  nothing), and the backend counts the calls of compiled graphs. With the autograd engine
  and ``surrogate``, no forward of a compiled model runs eagerly; with ``engine="func"``
  only the ``torch.func``-transformed forwards do (gradest runs them with the
  ``force_eager`` stance, ``gradest.model_lock.compiled_code_eager``), and the next call
  runs compiled again.

The ``Cost`` of a compiled run equals the eager one's, except the forwards the fused
terminal jagg/telescope forms add because a compiled backward cannot retain its graph.
Two more fixes have their own tests: the states' storage offsets (views into the stacked
path) cause no recompilation, and the process-wide eager stance survives overlapping
blocks in two threads.

Precision: float64, as every gradient test here (the shared fixture runs torch on one
thread). Inductor's CPU code generator supports float64, so the comparison stays tight:
AOT-eager graphs run the same ATen operators as eager (bitwise equal in practice), and
inductor's fused kernels reorder float64 arithmetic (~1e-16 relative), far inside
``RTOL``/``ATOL``. A float32 inductor case checks a float32 tolerance.

The matrix uses the ``aot_eager`` backend (Dynamo capture and AOTAutograd's compiled
backward, which is what meets gradest's autograd calls, without C++ compilation). One
test runs every estimator through inductor, the default backend; it needs a C++
compiler and is skipped cleanly without one.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable, Iterator
from typing import Any

import attrs
import pytest
import torch

import gradest
from gradest.models.mlp import MLPVelocity
from gradest.registry import builtin_estimators
from gradest.testing.problems import seeded_normal, tiny_mlp

DIM, BATCH, STEPS = 4, 3, 4
# float64: compiled and eager agree to rounding (see the module docstring).
RTOL, ATOL = 1e-10, 1e-12
RTOL32, ATOL32 = 1e-4, 1e-5

SPECS = sorted(builtin_estimators()) + [
    "exact:checkpoint=true",
    "jagg:checkpoint=true",
    "jagg:debias=2",
]
CASES = [
    (spec, kind)
    for spec in SPECS
    for kind in ("terminal", "stepwise")
    if kind in type(gradest.estimator(spec)).objectives
]
WRAPPINGS = ("torch.compile", "module.compile")

#: Forwards that ran the model's Python code, i.e. not a compiled graph.
EAGER = {"calls": 0}


class ProbedMLP(MLPVelocity):
    """tiny_mlp's model, counting the forwards that run eagerly."""

    def forward(self, z, t, y=None):
        if not torch.compiler.is_compiling():
            EAGER["calls"] += 1
        return super().forward(z, t, y)


def _model(dtype: torch.dtype = torch.float64) -> ProbedMLP:
    model = ProbedMLP(DIM, 16, 2)
    model.load_state_dict(tiny_mlp(DIM, hidden=16, seed=0).state_dict())
    return model.to(dtype)


class CountingBackend:
    """A torch.compile backend that counts compilations and calls of compiled graphs."""

    def __init__(self, inner: str = "aot_eager"):
        self.inner = inner
        self.graphs = 0
        self.calls = 0

    def __call__(self, gm: torch.fx.GraphModule, example_inputs) -> Callable:
        self.graphs += 1
        compiled: Any
        if self.inner == "inductor":
            from torch._inductor.compile_fx import compile_fx

            compiled = compile_fx(gm, example_inputs)
        else:
            from torch._dynamo.backends.debugging import aot_eager

            compiled = aot_eager(gm, example_inputs)

        def run(*args):
            self.calls += 1
            return compiled(*args)

        return run


def _compiled(wrapping: str, backend: CountingBackend, dtype=torch.float64) -> torch.nn.Module:
    if wrapping == "torch.compile":
        compiled: Any = torch.compile(_model(dtype), backend=backend, fullgraph=True)
        return compiled
    model = _model(dtype)
    model.compile(backend=backend, fullgraph=True)
    return model


@pytest.fixture(scope="module", autouse=True)
def _dynamo_strict() -> Iterator[None]:
    """A fresh Dynamo, recompile-limit hits raised (not silently run eagerly)."""
    torch._dynamo.reset()
    with torch._dynamo.config.patch(fail_on_recompile_limit_hit=True):
        yield
    torch._dynamo.reset()


@pytest.fixture(scope="module")
def compiled_models() -> dict[str, tuple[torch.nn.Module, CountingBackend]]:
    """One compiled model per wrapping for the whole module (compiled once, reused)."""
    # One backend object: Dynamo keys its cache by the backend too, and both models share
    # the code of ProbedMLP.forward (so its recompile limit).
    backend = CountingBackend()
    return {wrapping: (_compiled(wrapping, backend), backend) for wrapping in WRAPPINGS}


@pytest.fixture
def fresh_dynamo() -> Iterator[None]:
    """For a test that compiles models of its own: their cache entries would count toward
    the recompile limit of ProbedMLP.forward, which the shared models use too."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _objective(kind: str):
    if kind == "terminal":
        return gradest.TerminalObjective(lambda z: torch.sin(z).pow(2).sum() + 0.1 * (z**2).sum())
    return gradest.StepwiseObjective(lambda k, v, trajectory: (v**2).mean() * (k + 1))


def _inputs(model: torch.nn.Module, kind: str, flow, dtype=torch.float64) -> dict:
    noise = seeded_normal((BATCH, DIM), 0, dtype=dtype)
    if kind == "terminal":
        return {"noise": noise}
    return {"trajectory": gradest.rollout(model, flow, noise)}


def _run(spec: str, kind: str, model: torch.nn.Module, verb: str, dtype=torch.float64):
    """(gradients keyed as ``model.named_parameters()``, the sampling inputs, the cost),
    from ``estimate`` (``verb`` ``estimate:<engine>``) or ``surrogate`` + backward."""
    flow = gradest.RectifiedFlow(steps=STEPS)
    est = gradest.estimator(spec)  # auto: a new schedule, so the same (probing) first call
    inputs = _inputs(model, kind, flow, dtype)
    generator = torch.Generator().manual_seed(0)
    if verb == "surrogate":
        model.zero_grad(set_to_none=True)
        sur = est.surrogate(model, flow, _objective(kind), generator=generator, **inputs)
        sur.loss.backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        assert list(grads) == _user_names(model)
        model.zero_grad(set_to_none=True)
        return grads, inputs, sur.cost
    engine = verb.removeprefix("estimate:")
    result = est.estimate(
        model, flow, _objective(kind), generator=generator, engine=engine, **inputs
    )
    return dict(result.grads), inputs, result.cost


def _user_names(model: torch.nn.Module) -> list[str]:
    return [n for n, p in model.named_parameters() if p.requires_grad]


def _assert_equal_to_eager(compiled, grads, eager_grads, *, rtol=RTOL, atol=ATOL) -> None:
    # The names are the compiled model's own (OptimizedModule: "_orig_mod." + the inner
    # module's names), in named_parameters() order.
    assert list(grads) == _user_names(compiled)
    assert [n.removeprefix("_orig_mod.") for n in grads] == list(eager_grads)
    for name, grad in grads.items():
        expected = eager_grads[name.removeprefix("_orig_mod.")]
        torch.testing.assert_close(grad, expected, rtol=rtol, atol=atol, msg=name)
    assert any(g.abs().max() > 0 for g in grads.values())  # not a vacuous comparison


@pytest.mark.parametrize("verb", ["estimate:autograd", "estimate:func", "surrogate"])
@pytest.mark.parametrize("wrapping", WRAPPINGS)
@pytest.mark.parametrize(("spec", "kind"), CASES)
def test_compiled_model_gives_the_eager_gradients(spec, kind, wrapping, verb, compiled_models):
    compiled, backend = compiled_models[wrapping]
    eager = _model()
    eager_grads, eager_inputs, eager_cost = _run(spec, kind, eager, verb)

    EAGER["calls"], calls_before = 0, backend.calls
    grads, inputs, cost = _run(spec, kind, compiled, verb)
    eager_forwards = EAGER["calls"]

    if kind == "stepwise":  # the rollout ran through the compiled model too
        torch.testing.assert_close(
            inputs["trajectory"].states, eager_inputs["trajectory"].states, rtol=RTOL, atol=ATOL
        )
    _assert_equal_to_eager(compiled, grads, eager_grads)
    if verb == "estimate:func":
        # The torch.func-transformed forwards ran eagerly (a terminal exact chain has no
        # other forward); the compiled code is intact: the next call runs compiled, with
        # no eager forward.
        EAGER["calls"], calls_before = 0, backend.calls
        _run(spec, kind, compiled, "estimate:autograd")
        assert EAGER["calls"] == 0, "the func engine left the compiled model running eagerly"
    else:
        assert eager_forwards == 0, f"{eager_forwards} forwards of the compiled model ran eagerly"
    assert backend.calls > calls_before, "no compiled graph ran"

    # The same work, except that a compiled backward cannot retain its graph: the fused
    # terminal forms that keep a step's graph past its state VJP (jagg, telescope, and
    # auto's jagg candidates) take that VJP through one more forward of the step.
    extra = cost.forwards_with_graph - eager_cost.forwards_with_graph
    assert attrs.evolve(cost, forwards_with_graph=0) == attrs.evolve(
        eager_cost, forwards_with_graph=0
    )
    retains = kind == "terminal" and verb != "estimate:func" and "checkpoint" not in spec
    if kind == "terminal" and spec == "auto":  # its probe runs each jagg candidate 8 times
        assert extra >= 0, cost
    elif retains and spec.split(":")[0] in ("jagg", "telescope"):
        assert 0 <= extra <= STEPS, cost
        if spec.startswith("jagg"):  # the node at step N-1 is kept past its state VJP
            assert extra >= 1, cost
    else:
        assert extra == 0, cost


def test_names_are_those_of_the_model_passed(compiled_models):
    """torch.compile(model) keys gradients as its named_parameters() do ("_orig_mod.");
    model.compile() changes no name."""
    flow = gradest.RectifiedFlow(steps=STEPS)
    noise = seeded_normal((BATCH, DIM), 0)
    inner_names = _user_names(_model())
    for wrapping, (compiled, _) in compiled_models.items():
        result = gradest.estimator("exact").estimate(
            compiled, flow, _objective("terminal"), noise=noise
        )
        assert list(result.grads) == _user_names(compiled)
        prefix = "_orig_mod." if wrapping == "torch.compile" else ""
        assert list(result.grads) == [prefix + n for n in inner_names]
        # An optimizer over model.parameters() and these names agree one to one.
        params = dict(compiled.named_parameters())
        for name, grad in result.grads.items():
            assert grad.shape == params[name].shape


def test_func_engine_without_the_eager_stance_would_break_compiled_code(fresh_dynamo):
    """The failure the engine avoids: torch.func.vjp over a compiled module (fullgraph)
    raises in Dynamo; gradest's func engine on the same model succeeds."""
    from torch.func import functional_call, vjp

    backend = CountingBackend()
    model = _compiled("torch.compile", backend)
    z, t = seeded_normal((BATCH, DIM), 0), torch.full((BATCH,), 0.5, dtype=torch.float64)
    params = {n: p.detach() for n, p in model.named_parameters()}
    with pytest.raises(Exception, match="functorch"):
        vjp(lambda p: functional_call(model, p, (z, t)), params)
    torch._dynamo.reset()  # forget the frame Dynamo gave up on
    model = _compiled("torch.compile", backend)
    eager_grads, _, _ = _run("exact", "terminal", _model(), "estimate:func")
    grads, _, _ = _run("exact", "terminal", model, "estimate:func")
    _assert_equal_to_eager(model, grads, eager_grads)


def test_eager_blocks_overlapping_in_threads_restore_the_stance():
    """compiled_code_eager's stance is process-wide: of overlapping blocks (threads),
    the first enters it and the last leaves it; no block restores another's."""
    import threading

    from torch._dynamo import eval_frame

    from gradest.model_lock import compiled_code_eager

    def stance() -> str:
        return eval_frame._stance.stance

    entered, release, done = threading.Event(), threading.Event(), threading.Event()

    def other() -> None:
        with compiled_code_eager():
            entered.set()
            release.wait(10)
        done.set()

    assert stance() == "default"
    thread = threading.Thread(target=other)
    thread.start()
    assert entered.wait(10)
    with compiled_code_eager():
        release.set()
        assert done.wait(10)  # the other block left first
        assert stance() == "force_eager"
    thread.join()
    assert stance() == "default"


def test_states_storage_offsets_cause_no_recompilation(fresh_dynamo):
    """States are views into the stacked path. Dynamo guards a view's storage offset
    (offset 0 apart from the others once shapes are dynamic), so without gradest's copy
    this sequence compiled a fourth graph for an offset alone; such recompilations add
    up to the recompile limit, after which torch runs the model eagerly for good."""
    from torch._dynamo.utils import guard_failures

    backend = CountingBackend()
    model = _compiled("torch.compile", backend)
    flow = gradest.RectifiedFlow(steps=STEPS)
    noise = seeded_normal((BATCH, DIM), 0)
    for spec in ("sdo:samples=2", "exact:checkpoint=true", "jagg", "exact"):
        gradest.estimator(spec).estimate(
            model, flow, _objective("terminal"), noise=noise, generator=torch.Generator()
        )
    reasons = [str(failure) for failure in guard_failures[ProbedMLP.forward.__code__]]
    assert not [r for r in reasons if "storage_offset" in r], reasons
    # grad mode on/off, state requiring grad or not, then the stacked (dynamic) batch
    assert backend.graphs == 3, reasons


def _has_cpp_compiler() -> bool:
    return any(shutil.which(cxx) for cxx in ("g++", "c++", "clang++"))


@pytest.mark.slow
@pytest.mark.skipif(not _has_cpp_compiler(), reason="inductor needs a C++ compiler on CPU")
def test_inductor_gives_the_eager_gradients(fresh_dynamo):
    """Every estimator with the default backend (inductor's generated C++), both kinds,
    float64 and one float32 case; one compiled model, compiled once."""
    backend = CountingBackend("inductor")
    compiled = _compiled("torch.compile", backend)
    eager = _model()
    for spec, kind in CASES:
        for verb in ("estimate:autograd", "surrogate"):
            eager_grads, _, _ = _run(spec, kind, eager, verb)
            EAGER["calls"], calls_before = 0, backend.calls
            grads, _, _ = _run(spec, kind, compiled, verb)
            assert backend.calls > calls_before and EAGER["calls"] == 0, (spec, kind, verb)
            _assert_equal_to_eager(compiled, grads, eager_grads)
    eager_grads, _, _ = _run("jagg", "stepwise", eager, "estimate:func")
    grads, _, _ = _run("jagg", "stepwise", compiled, "estimate:func")
    _assert_equal_to_eager(compiled, grads, eager_grads)

    compiled32 = _compiled("module.compile", CountingBackend("inductor"), torch.float32)
    eager32 = _model(torch.float32)
    for verb in ("estimate:autograd", "surrogate"):
        eager_grads, _, _ = _run("exact", "terminal", eager32, verb, torch.float32)
        grads, _, _ = _run("exact", "terminal", compiled32, verb, torch.float32)
        _assert_equal_to_eager(compiled32, grads, eager_grads, rtol=RTOL32, atol=ATOL32)
