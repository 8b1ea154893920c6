"""Gate 1: is the candidate correct?

Each trial draws a fresh input set under a fresh seed. The candidate runs first, on its
own clones of the inputs (under a dispatcher recorder when the problem forbids ops);
the device is synchronized (so work left on other streams is finished) before anything
is checked. Then:
- the inputs it was given must be unchanged (unless the reference itself changes its
  inputs, in which case they must end up as the reference leaves them);
- every output must be a plain torch.Tensor (not a subclass), with the reference's
  structure, shape, dtype and device;
- no NaN or Inf where the reference has none; every element within atol + rtol * |ref|;
- and ||out - ref|| / ||ref|| within the dtype's relative L2 bound (problem.DEFAULT_TOLERANCE).
  An output whose reference values all lie within atol of zero is judged by that bound
  alone: the elementwise test would pass anything as small (`x * 0` for a softmax of wide
  rows). The comparison names the test that decided (`test`).
Unless the problem says `precision = "as_drawn"`, the last trials run on exposing draws
(random signs, spread magnitudes: problem.expose), where a lower precision than the
outputs' shows; an exposing draw on which the reference itself is not finite is skipped.
After each trial both sides' outputs are poisoned (defences.py), so a candidate that
returns memory it never wrote is caught by the poison it finds there.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from contextlib import nullcontext
from dataclasses import asdict, dataclass, field

import torch

from kforge.harness.candidate import Candidate
from kforge.harness.defences import OpRecorder, check_forbidden, poison, poisoned_elements
from kforge.harness.loading import synchronize
from kforge.harness.problem import Problem, flatten_outputs

COMPARE_CHUNK = 1 << 24  # elements compared at a time (16 Mi: ~130 MB per float64 temporary)


@dataclass
class Comparison:
    ok: bool
    failure: str | None = None  # structure, output_type, shape, dtype, device, nonfinite, values, poison
    reason: str | None = None
    max_abs_err: float = 0.0
    max_rel_err: float = 0.0  # |out - ref| / max(|ref|, atol)
    mismatch_frac: float = 0.0
    rel_l2_err: float = 0.0  # ||out - ref|| / ||ref||
    test: str | None = None  # the test that decided: elementwise, rel_l2, rel_l2_near_zero (or a failure's kind)

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class CorrectnessReport:
    passed: bool
    trials: int  # trials run (stops at the first failure)
    trials_passed: int
    seeds: list[int]
    atol: float
    rtol: float
    max_abs_err: float = 0.0
    max_rel_err: float = 0.0
    mismatch_frac: float = 0.0
    rel_l2_err: float = 0.0
    rel_l2_bound: float | None = None
    failure: str | None = None
    reason: str | None = None
    test: str | None = None  # which test failed it, or the tests it passed ("elementwise+rel_l2")
    exposed_trials: int = 0  # of `trials`, those on exposing draws
    exposed_skipped: int = 0  # exposing draws on which the reference was not finite
    reference_outputs: list = field(default_factory=list, repr=False)  # last trial's, not serialized
    last_inputs: list = field(default_factory=list, repr=False)

    def to_dict(self) -> dict:
        out = asdict(self)
        out.pop("reference_outputs")
        out.pop("last_inputs")
        return out


def check_correctness(
    problem: Problem,
    reference,
    candidate: Candidate,
    candidate_model,
    seeds: Sequence[int],
    device: torch.device,
    probe_seed: int,
    exposed_seeds: Sequence[int] = (),
) -> CorrectnessReport:
    # One probe call of the reference gives the outputs' shapes. Right before each call of
    # the candidate, tensors of those shapes are filled with poison and freed: a candidate
    # that returns memory it never wrote most likely gets them back (both CPU malloc and
    # the CUDA caching allocator hand out the block freed last), and shows the poison.
    with torch.no_grad():
        probe = problem.run_reference(reference, problem.make_inputs(probe_seed, device))
    bait_like = [t for t in flatten_outputs(probe) if isinstance(t, torch.Tensor)]
    poison_outputs(probe, reference)
    del probe
    worst = Comparison(ok=True)
    passed = skipped = 0
    ref_out, inputs = None, []
    seeds = list(seeds) + list(exposed_seeds)
    for trial, seed in enumerate(seeds, start=1):
        exposed = trial > len(seeds) - len(exposed_seeds)
        inputs = problem.make_inputs(seed, device, exposed=exposed)
        pristine = clone_arguments(inputs)
        candidate_inputs = clone_arguments(inputs)
        with torch.no_grad():
            recorder = OpRecorder() if problem.forbidden_ops else nullcontext()
            bait = [torch.empty_like(t) for t in bait_like]
            poison(bait)
            del bait
            with recorder:
                out = candidate.run(candidate_model, candidate_inputs, device)
            if problem.forbidden_ops:
                check_forbidden(recorder.ops, problem.forbidden_ops)
            ref_out = problem.run_reference(reference, inputs)
            synchronize(device)
        if exposed and not outputs_finite(ref_out):
            skipped += 1
            poison_outputs(ref_out, reference)
            poison_outputs(out, candidate_model)
            continue

        result = (compare_inputs(pristine, inputs, candidate_inputs, problem, exposed)
                  or compare_outputs(ref_out, out, problem, exposed))
        worst = _worse(worst, result)
        if trial < len(seeds):  # the last trial's reference outputs size the roofline
            poison_outputs(ref_out, reference)
            poison_outputs(out, candidate_model)
        if not result.ok:
            where = "an exposing draw" if exposed else "trial"
            report = _report(problem, ref_out, False, trial, passed, seeds, worst,
                             f"{where} {trial}: {result.reason}", result.failure, result.test)
            report.exposed_trials, report.exposed_skipped = max(0, trial - len(seeds) + len(exposed_seeds)), skipped
            return report
        passed += 1
    report = _report(problem, ref_out, True, len(seeds), passed, seeds, worst, None, None, worst.test)
    report.exposed_trials, report.exposed_skipped = len(exposed_seeds), skipped
    report.reference_outputs = flatten_outputs(ref_out)
    report.last_inputs = inputs
    return report


def compare_inputs(pristine: Sequence, reference_inputs: Sequence, candidate_inputs: Sequence,
                   problem: Problem, exposed: bool = False) -> Comparison | None:
    """A failure if the candidate left its inputs otherwise than the reference did, else None.
    Inputs the reference leaves alone must come back bit for bit; inputs it changes in place
    (an in-place op such as RoPE) are results, held to the problem's tolerance like outputs:
    a kernel rounding once where eager PyTorch rounds twice is one step away, not wrong."""
    changed = [i for i, (x, p) in enumerate(zip(reference_inputs, pristine)) if not arguments_equal([x], [p])]
    kept = [i for i in range(len(pristine)) if i not in changed]
    if not arguments_equal([candidate_inputs[i] for i in kept], [pristine[i] for i in kept]):
        return Comparison(ok=False, failure="mutated_inputs", reason="the candidate modified its inputs"
                          + (" (beyond those the reference changes in place)" if changed else ""))
    if changed:
        mutated = compare_outputs([reference_inputs[i] for i in changed], [candidate_inputs[i] for i in changed],
                                  problem, exposed)
        if not mutated.ok:
            return Comparison(ok=False, failure="mutated_inputs",
                              reason=f"the reference changes its inputs in place and the candidate leaves them "
                                     f"differently: {mutated.reason}")
    return None


def compare_outputs(reference: object, output: object, problem: Problem, exposed: bool = False) -> Comparison:
    refs, outs = flatten_outputs(reference), flatten_outputs(output)
    if len(refs) != len(outs) or isinstance(reference, torch.Tensor) != isinstance(output, torch.Tensor):
        return Comparison(
            ok=False, failure="structure",
            reason=f"expected {_describe_structure(reference)}, got {_describe_structure(output)}",
        )
    worst = Comparison(ok=True)
    for index, (ref, out) in enumerate(zip(refs, outs)):
        label = "output" if len(refs) == 1 else f"output[{index}]"
        result = _compare_leaf(ref, out, label, problem, exposed)
        worst = _worse(worst, result)
        if not result.ok:
            stale = poisoned_elements(out) if result.failure in ("values", "nonfinite") else 0
            if stale:
                result.failure = "poison"
                result.reason = (f"{label} returned memory it never wrote: {stale} element(s) still hold "
                                 "the poison written into freed outputs")
            return result
    return worst


def describe_output(output) -> dict:
    """What the candidate's worker says about one output: its structure, and for each tensor
    its type, shape, dtype and device (the values travel through the mailbox)."""
    if type(output) in (tuple, list):  # by identity too: a subclass may defer its work to its iteration
        return {type(output).__name__: [describe_output(item) for item in output]}
    if isinstance(output, torch.Tensor):
        # by identity, not by name: a subclass may call itself torch.Tensor (`__module__`,
        # `__qualname__`) and defer its work to the copy after the timed call
        kind = type(output)
        name = "torch.Tensor" if kind is torch.Tensor else f"subclass {kind.__module__}.{kind.__qualname__}"
        return {"output": {"type": name,
                           "shape": list(output.shape), "dtype": str(output.dtype).removeprefix("torch."),
                           "device": output.device.type}}
    if output is None or isinstance(output, (bool, int, float, str)):
        return {"value": output}
    return {"other": type(output).__qualname__}


def _claimed_leaves(claims) -> list[tuple[str, object]]:
    if not isinstance(claims, dict) or len(claims) != 1:
        raise ValueError
    (kind, body), = claims.items()
    if kind in ("list", "tuple") and isinstance(body, list):
        return [leaf for item in body for leaf in _claimed_leaves(item)]
    if kind == "output" and isinstance(body, dict) and isinstance(body.get("shape"), list):
        return [(kind, body)]
    if kind in ("value", "other"):
        return [(kind, body)]
    raise ValueError


def compare_claimed(reference: object, claims, mailbox: Sequence[torch.Tensor], problem: Problem,
                    exposed: bool = False) -> Comparison:
    """Compare the candidate's output, as its worker described it (`claims`) and copied it into
    the mailbox, with the reference's. The claims are untrusted: they can only make the
    candidate fail (a shape, dtype or type that does not match), never pass, since every
    value compared is read from the mailbox."""
    refs = flatten_outputs(reference)
    try:
        leaves = _claimed_leaves(claims)
    except ValueError:
        return Comparison(ok=False, failure="structure",
                          reason=f"the candidate's worker described its output in no known form: {claims!r:.120}")
    single = isinstance(claims, dict) and "output" in claims
    if len(refs) != len(leaves) or isinstance(reference, torch.Tensor) != single:
        return Comparison(ok=False, failure="structure",
                          reason=f"expected {_describe_structure(reference)}, got {len(leaves)} output(s)")
    worst, slot = Comparison(ok=True), 0
    for index, (ref, (kind, body)) in enumerate(zip(refs, leaves)):
        label = "output" if len(refs) == 1 else f"output[{index}]"
        if not isinstance(ref, torch.Tensor):
            ok = kind == "value" and type(body) is type(ref) and body == ref
            result = Comparison(ok=ok, failure=None if ok else "values",
                                reason=None if ok else f"{label} is {body!r:.60}, expected {ref!r:.60}")
        elif kind != "output":
            result = Comparison(ok=False, failure="output_type",
                                reason=f"{label} is {'a ' + str(body) if kind == 'other' else repr(body)}, "
                                       "not a plain torch.Tensor")
        else:
            result = _check_claim(ref, body, label) or compare_leaf_values(ref, mailbox[slot], label, problem,
                                                                           exposed)
            stale = poisoned_elements(mailbox[slot]) if result.failure in ("values", "nonfinite") else 0
            if stale:
                result.failure = "poison"
                result.reason = (f"{label} was never delivered whole: {stale} element(s) still hold the poison "
                                 "written before the call")
            slot += 1
        worst = _worse(worst, result)
        if not result.ok:
            return result
    return worst


def _check_claim(ref: torch.Tensor, claim: dict, label: str) -> Comparison | None:
    if claim.get("type") != "torch.Tensor":
        return Comparison(ok=False, failure="output_type",
                          reason=f"{label} is a {claim.get('type')!s:.80}, not a plain torch.Tensor")
    if claim.get("shape") != list(ref.shape):
        return Comparison(ok=False, failure="shape",
                          reason=f"{label} has shape {tuple(claim.get('shape'))}, expected {tuple(ref.shape)}")
    if claim.get("dtype") != str(ref.dtype).removeprefix("torch."):
        return Comparison(ok=False, failure="dtype", reason=f"{label} has dtype {claim.get('dtype')!s:.40}, "
                                                            f"expected {ref.dtype}")
    if claim.get("device") != ref.device.type:
        return Comparison(ok=False, failure="device",
                          reason=f"{label} is on {claim.get('device')!s:.40}, expected {ref.device.type}")
    return None


def poison_outputs(outputs: object, owner) -> None:
    """Poison the tensors of `outputs`, except memory `owner` (a model) keeps as its state."""
    state = list(owner.parameters()) + list(owner.buffers()) if isinstance(owner, torch.nn.Module) else []
    owned = {t.untyped_storage().data_ptr() for t in state}
    poison(t for t in flatten_outputs(outputs)
           if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in owned)


def _compare_leaf(ref, out, label: str, problem: Problem, exposed: bool = False) -> Comparison:
    if not isinstance(ref, torch.Tensor):
        ok = type(out) is type(ref) and out == ref
        return Comparison(ok=ok, failure=None if ok else "values",
                          reason=None if ok else f"{label} is {out!r}, expected {ref!r}")
    if type(out) is not torch.Tensor:
        return Comparison(ok=False, failure="output_type",
                          reason=f"{label} is a {type(out).__qualname__}, not a plain torch.Tensor")
    if out.shape != ref.shape:
        return Comparison(ok=False, failure="shape",
                          reason=f"{label} has shape {tuple(out.shape)}, expected {tuple(ref.shape)}")
    if out.dtype != ref.dtype:
        return Comparison(ok=False, failure="dtype", reason=f"{label} has dtype {out.dtype}, expected {ref.dtype}")
    if out.device != ref.device:
        return Comparison(ok=False, failure="device",
                          reason=f"{label} is on {out.device}, expected {ref.device}")
    return compare_leaf_values(ref, out, label, problem, exposed)


def compare_leaf_values(ref: torch.Tensor, out: torch.Tensor, label: str, problem: Problem,
                        exposed: bool = False) -> Comparison:
    """In float64: no NaN/Inf where the reference has none, every element within atol +
    rtol * |ref|, the relative L2 error within its bound; an output whose reference is all
    within atol of zero, or of an exposing draw (whose scale atol was not set for), by the
    relative L2 bound alone (the module's docstring)."""
    atol, rtol = problem.tolerance_for(ref.dtype)
    bound = problem.rel_l2_for(ref.dtype)
    wide = torch.complex128 if ref.is_complex() else torch.float64
    flat_ref, flat_out = ref.detach().reshape(-1), out.detach().reshape(-1)
    zero = torch.zeros((), dtype=torch.float64, device=ref.device)
    floor = atol if atol > 0 else torch.finfo(torch.float64).tiny
    nonfinite = mismatches = 0
    first_nonfinite = first_mismatch = None
    max_abs = max_rel = diff_norm = ref_norm = ref_max = 0.0
    # Chunk by chunk, so that the float64 temporaries (a dozen of them) stay ~COMPARE_CHUNK
    # elements each: a whole 824 MB bf16 output at once took 24 GB.
    for start in range(0, flat_ref.numel(), COMPARE_CHUNK):
        r = flat_ref[start:start + COMPARE_CHUNK].to(wide)
        o = flat_out[start:start + COMPARE_CHUNK].to(wide)
        ref_finite, out_finite = torch.isfinite(r), torch.isfinite(o)
        new_nonfinite = out_finite.logical_not() & ref_finite
        count = int(new_nonfinite.sum())
        if count and first_nonfinite is None:
            first_nonfinite = start + int(new_nonfinite.nonzero()[0])
        nonfinite += count
        close = torch.isclose(o, r, atol=atol, rtol=rtol, equal_nan=True)
        count = int(close.logical_not().sum())
        if count and first_mismatch is None:
            first_mismatch = start + int(close.logical_not().nonzero()[0])
        mismatches += count
        both = ref_finite & out_finite
        diff = (o - r).abs().where(both, zero)
        max_abs = max(max_abs, float(diff.max()))
        max_rel = max(max_rel, float((diff / r.abs().clamp_min(floor)).where(both, zero).max()))
        diff_norm = math.hypot(diff_norm, float(torch.linalg.vector_norm(diff)))
        ref_norm = math.hypot(ref_norm, float(torch.linalg.vector_norm(r.abs().where(both, zero))))
        ref_max = max(ref_max, float(r.abs().where(ref_finite, zero).max()) if r.numel() else 0.0)
    if nonfinite:
        return Comparison(
            ok=False, failure="nonfinite",
            reason=f"{label} has {nonfinite} NaN/Inf where the reference is finite "
                   f"(first at {_unravel(first_nonfinite, ref.shape)})",
        )
    numel = flat_ref.numel()
    rel_l2 = diff_norm / ref_norm if ref_norm > 0 else (0.0 if diff_norm == 0 else math.inf)
    result = Comparison(
        ok=True,
        max_abs_err=max_abs,
        max_rel_err=max_rel,
        mismatch_frac=mismatches / numel if numel else 0.0,
        rel_l2_err=rel_l2,
        test="elementwise" if bound is None else "elementwise+rel_l2",
    )
    near_zero = bound is not None and ref_norm > 0 and ref_max <= atol
    if near_zero or (exposed and bound is not None):
        # every reference value is within atol of zero, or the draw's scale is not the one
        # atol was set for: only the relative error can tell
        result.test = "rel_l2_near_zero" if near_zero else "rel_l2_exposed"
        if rel_l2 > bound:
            why = (f"every reference value is within atol={atol:g} of zero, so only the relative error tells"
                   if near_zero else "on inputs with random signs and spread magnitudes: a lower precision?")
            result.ok, result.failure = False, "values"
            result.reason = f"{label}: relative L2 error {rel_l2:.3g} over the bound {bound:g} ({why})"
    elif mismatches:
        result.ok, result.failure, result.test = False, "values", "elementwise"
        result.reason = (
            f"{label}: {100 * result.mismatch_frac:.3g}% of elements outside atol={atol:g}, rtol={rtol:g} "
            f"(max abs err {result.max_abs_err:.3g}; at {_unravel(first_mismatch, ref.shape)} got "
            f"{flat_out[first_mismatch].to(wide).item():.6g}, expected {flat_ref[first_mismatch].to(wide).item():.6g})"
        )
    elif bound is not None and rel_l2 > bound:
        result.ok, result.failure, result.test = False, "values", "rel_l2"
        result.reason = (f"{label}: relative L2 error {rel_l2:.3g} over the bound {bound:g} for {ref.dtype} "
                         f"(every element within atol={atol:g}, rtol={rtol:g}): computed in a lower precision?")
    return result


def outputs_finite(outputs: object) -> bool:
    """Are all of the reference's floating outputs finite? (An exposing draw on which they
    are not is outside the problem's domain: it is skipped.)"""
    return all(bool(torch.isfinite(t).all()) for t in flatten_outputs(outputs)
               if isinstance(t, torch.Tensor) and (t.is_floating_point() or t.is_complex()))


def _unravel(flat: int, shape: torch.Size) -> tuple[int, ...]:
    """The index of element `flat` of a row-major tensor of `shape`."""
    index = []
    for size in reversed(shape):
        flat, i = divmod(flat, size)
        index.append(i)
    return tuple(reversed(index))


def clone_arguments(values: Sequence) -> list:
    return [v.clone() if isinstance(v, torch.Tensor) else v for v in values]


def arguments_equal(a: Sequence, b: Sequence) -> bool:
    """Exact equality of two argument lists (NaN equals NaN: an input may hold them)."""
    if len(a) != len(b):
        return False
    for x, y in zip(a, b):
        if isinstance(x, torch.Tensor) != isinstance(y, torch.Tensor):
            return False
        if not isinstance(x, torch.Tensor):
            if x != y:
                return False
            continue
        if x.shape != y.shape or x.dtype != y.dtype:
            return False
        if x.is_floating_point() or x.is_complex():
            if not bool(((x == y) | (torch.isnan(x) & torch.isnan(y))).all()):
                return False
        elif not torch.equal(x, y):
            return False
    return True


def _describe_structure(value: object) -> str:
    if isinstance(value, torch.Tensor):
        return "a tensor"
    if isinstance(value, (tuple, list)):
        return f"a {type(value).__name__} of {len(flatten_outputs(value))} output(s)"
    return f"a {type(value).__name__}"


def _worse(a: Comparison, b: Comparison) -> Comparison:
    """Keep the worst error figures seen across outputs and trials."""
    return Comparison(
        ok=a.ok and b.ok,
        test=b.test or a.test,
        max_abs_err=max(a.max_abs_err, b.max_abs_err),
        max_rel_err=max(a.max_rel_err, b.max_rel_err),
        mismatch_frac=max(a.mismatch_frac, b.mismatch_frac),
        rel_l2_err=max(a.rel_l2_err, b.rel_l2_err),
    )


def _report(problem, ref_out, passed, trials, trials_passed, seeds, worst: Comparison, reason, failure,
            test=None):
    first_tensor = next((x for x in flatten_outputs(ref_out) if isinstance(x, torch.Tensor)), None)
    atol, rtol = problem.tolerance_for(first_tensor.dtype) if first_tensor is not None else (0.0, 0.0)
    bound = problem.rel_l2_for(first_tensor.dtype) if first_tensor is not None else None
    return CorrectnessReport(
        passed=passed,
        trials=trials,
        trials_passed=trials_passed,
        seeds=list(seeds),
        atol=atol,
        rtol=rtol,
        max_abs_err=worst.max_abs_err,
        max_rel_err=worst.max_rel_err,
        mismatch_frac=worst.mismatch_frac,
        rel_l2_err=worst.rel_l2_err,
        rel_l2_bound=bound,
        failure=failure,
        reason=reason,
        test=test,
    )
