"""Argument checks shared across ringviz: a bad value raises an error that names the argument."""

from __future__ import annotations

import math
import os
from collections.abc import Callable

import numpy as np
import torch


def check_int(name: str, value: object, minimum: int = 1) -> int:
    """Return ``value`` as an int if it is an integer >= ``minimum``; raise otherwise.

    >>> check_int("window", 4)
    4
    >>> check_int("window", 0)
    Traceback (most recent call last):
    ValueError: window must be >= 1, got 0
    """
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return int(value)


def check_scale(scale: object) -> float | None:
    """Return ``scale`` as a float if it is None or a positive finite real number; raise otherwise.

    Checked before anything is written, so a bad scale never leaves a half-done step behind.

    >>> check_scale(0.125)
    0.125
    >>> check_scale(float("nan"))
    Traceback (most recent call last):
    ValueError: scale must be a positive finite number, got nan
    """
    if scale is None:
        return None
    if isinstance(scale, bool) or not isinstance(scale, (int, float, np.integer, np.floating)):
        raise TypeError(f"scale must be None or a real number, got {type(scale).__name__}")
    if not math.isfinite(scale) or scale <= 0:
        raise ValueError(f"scale must be a positive finite number, got {scale!r}")
    return float(scale)


def check_tensor(name: str, value: object, device: torch.device) -> torch.Tensor:
    """Return ``value`` if it is a tensor on ``device``; raise otherwise, naming it."""
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
    if value.device != device:
        raise ValueError(f"{name} is on {value.device}, the cache on {device}")
    return value


def device_memory(device: torch.device) -> int | None:
    """Bytes a tensor on ``device`` may take at most: the machine's physical memory on the
    CPU (``os.sysconf``), the free memory on a CUDA device (``torch.cuda.mem_get_info``, what
    an allocation can get now); None where not known (other device types)."""
    if device.type == "cpu":
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    return None


def check_fits(what: str, nbytes: int, device: torch.device) -> None:
    """Raise ValueError, before allocating, if ``nbytes`` of storage cannot fit ``device``
    (:func:`device_memory`): a huge window would otherwise be zero-filled until the kernel
    kills the process. ``device='meta'`` holds no data, so no storage can live there.

    >>> check_fits("a ring", 2**70, torch.device("cpu"))  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ValueError: a ring needs 1099511627776.0 GiB of storage, more than the cpu's ... GiB ...
    """
    if device.type == "meta":
        raise ValueError(f"{what} cannot live on device 'meta': a meta tensor holds no data, "
                         f"so nothing written could be read back")
    limit = device_memory(device)
    if limit is not None and nbytes > limit:
        where = "physical memory" if device.type == "cpu" else "free memory"
        raise ValueError(f"{what} needs {nbytes / 2**30:.1f} GiB of storage, more than the "
                         f"{device}'s {limit / 2**30:.1f} GiB of {where}: lower the window, "
                         f"sinks, capacity or batch")


def check_kv(k: object, v: object, *, batch_size: int, num_kv_heads: int, head_dim: int,
             dtype: torch.dtype, device: torch.device) -> None:
    """New keys and values for a cache: one shape ``(B, num_kv_heads, T>=1, head_dim)``, its dtype.

    >>> x = torch.zeros(1, 2, 3, 4)
    >>> check_kv(x, x[:, :1], batch_size=1, num_kv_heads=2, head_dim=4, dtype=x.dtype,
    ...          device=x.device)
    Traceback (most recent call last):
    ValueError: v must be (B=1, num_kv_heads=2, T>=1, head_dim=4), got (1, 1, 3, 4)
    """
    for name, t in (("k", k), ("v", v)):
        check_tensor(name, t, device)
        if t.dtype != dtype:
            raise TypeError(f"{name} has dtype {t.dtype}, the cache holds {dtype}")
        if t.ndim != 4 or (t.shape[0], t.shape[1], t.shape[3]) != (batch_size, num_kv_heads,
                                                                     head_dim) or t.shape[2] == 0:
            raise ValueError(f"{name} must be (B={batch_size}, num_kv_heads={num_kv_heads}, T>=1, "
                             f"head_dim={head_dim}), got {tuple(t.shape)}")
    if k.shape != v.shape:
        raise ValueError(f"k and v shapes differ: {tuple(k.shape)} vs {tuple(v.shape)}")


def check_query(q: object, T: int, *, batch_size: int, num_kv_heads: int, head_dim: int,
                dtype: torch.dtype, device: torch.device, q_positions: object = None,
                last: bool = False) -> None:
    """``q`` must be ``(B, Hq, T, head_dim)`` on ``device`` in ``dtype``, ``Hq % Hkv == 0``;
    ``q_positions``, when given, an integer tensor ``(B, T)``. ``last=True`` also takes only
    the chunk's last ``1 .. T`` queries (Gemma 4's KV-shared layers keep no others)."""
    check_tensor("q", q, device)
    if q.dtype != dtype:
        raise TypeError(f"q has dtype {q.dtype}, the cache holds {dtype}")
    Tq = q.shape[2] if q.ndim == 4 else -1
    if q.ndim != 4 or q.shape[0] != batch_size or q.shape[3] != head_dim \
            or not (1 <= Tq <= T if last else Tq == T):
        what = f"1..{T}" if last else T
        raise ValueError(f"q must be (B={batch_size}, Hq, T={what}, head_dim={head_dim}), "
                         f"got {tuple(q.shape)}")
    if q.shape[1] == 0 or q.shape[1] % num_kv_heads:
        raise ValueError(f"Hq={q.shape[1]} query heads is not a positive multiple of "
                         f"num_kv_heads={num_kv_heads}")
    if q_positions is None:
        return
    if not isinstance(q_positions, torch.Tensor):
        raise TypeError(f"q_positions must be a torch.Tensor, got {type(q_positions).__name__}")
    if q_positions.shape != (batch_size, T) or q_positions.is_floating_point():
        raise ValueError(f"q_positions must be integer (B, T) = {(batch_size, T)}, got "
                         f"{q_positions.dtype} {tuple(q_positions.shape)}")


def check_positions(positions: torch.Tensor, newest: torch.Tensor, T: int) -> None:
    """New positions ``(B, T)`` that may follow rows whose newest stored positions are ``newest``.

    Integer, of shape ``(len(newest), T)``; per row, every position but padding (-1) after the
    row's newest and after the ones before it in the chunk. One host sync when valid
    (:func:`position_faults`, then :func:`raise_position_fault` if any).

    >>> check_positions(torch.tensor([[3, -1, 5]]), torch.tensor([2]), 3)
    >>> check_positions(torch.tensor([[2]]), torch.tensor([2]), 1)
    Traceback (most recent call last):
    ValueError: row 0: position 2 is not after the row's cached positions (newest 2)
    """
    bad, before = position_faults(positions, newest, T)
    if bool(bad.any()):  # the only host sync of a valid call
        raise_position_fault(positions, newest, bad, before)


def position_faults(positions: torch.Tensor, newest: torch.Tensor, T: int
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`check_positions` without reading anything back: the dtype and shape are checked
    (raising), then ``bad`` (B, T), the tokens that do not come after their row's previous
    position, and ``before`` (B, T), that previous position (-1: none), are computed on the
    device, so a caller can read them in the same sync as other values."""
    B = newest.shape[0]
    if positions.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"positions must be int64 or int32, got {positions.dtype}")
    if positions.shape != (B, T):
        raise ValueError(f"positions must be (B, T) = {(B, T)}, got {tuple(positions.shape)}")
    before = newest[:, None]  # (B, 1) newest position stored so far, >= -1
    if T > 1:  # ... or earlier in this chunk
        running = torch.cummax(positions.clamp_min(-1), dim=1).values
        before = torch.cat([before, torch.maximum(running[:, :-1], before)], dim=1)
    # all but padding must come after `before` (>= -1): this also refuses -2, -3, ...
    return (positions <= before) & (positions != -1), before.expand(B, T)


def raise_position_fault(positions: torch.Tensor, newest: torch.Tensor, bad: torch.Tensor,
                         before: torch.Tensor) -> None:
    """Raise ValueError for the first fault :func:`position_faults` found (host reads: this
    runs only on a refused call)."""
    if bool((positions < -1).any()):
        raise ValueError("positions must be >= 0, or -1 for padding; got other negatives")
    b, t = (int(i) for i in bad.nonzero()[0])
    pos, last = int(positions[b, t]), int(newest[b])
    if pos <= last:
        raise ValueError(f"row {b}: position {pos} is not after the row's cached "
                         f"positions (newest {last})")
    raise ValueError(f"row {b}: positions must strictly increase, got {pos} after "
                     f"{int(before[b, t])}")


def missing_positions(stored: torch.Tensor, lengths: torch.Tensor, window: int
                      ) -> list[list[int]]:
    """Per row b: positions ``lengths[b] - W + 1 .. lengths[b] - 1`` (what a query at
    ``lengths[b]`` needs) that ``stored`` (B, slots) does not hold. A host sync.

    >>> missing_positions(torch.tensor([[4, 5, 2, 3]]), torch.tensor([3]), window=4)
    [[0, 1]]
    """
    out = []
    for row, n in zip(stored.tolist(), lengths.tolist(), strict=True):
        held = set(row)
        out.append([p for p in range(max(0, n - window + 1), n) if p not in held])
    return out


def check_sink_rope(rope: object, sinks: int, head_dim: int, dtype: torch.dtype,
                    device: torch.device) -> Callable | None:
    """Return ``rope`` if it is None or a rotation usable for ``sinks`` sink keys; raise otherwise.

    A callable is probed once on a tiny tensor: it must return ``x``'s shape and dtype, leave
    position 0 unrotated, and turn position 1 keeping its norm (a rotation), so a wrong function
    fails here rather than as silently wrong attention later.
    """
    if rope is None:
        return None
    if not callable(rope):
        raise TypeError(f"sink_rope must be None or a callable f(x, positions), "
                        f"got {type(rope).__name__}")
    if sinks == 0:
        raise ValueError("sink_rope rotates sink keys: it needs sinks >= 1, got sinks=0")
    x = torch.linspace(-1.0, 1.0, 2 * head_dim, dtype=dtype, device=device).view(1, 1, 2, head_dim)
    with torch.no_grad():
        try:
            out = rope(x, torch.tensor([[0, 1]], device=device))
        except Exception as err:  # noqa: BLE001 -- any failure means an unusable rotation
            raise TypeError(f"sink_rope(x, positions) failed on a (1, 1, 2, {head_dim}) "
                            f"probe: {err!r}") from err
        if not isinstance(out, torch.Tensor) or out.shape != x.shape or out.dtype != dtype:
            raise TypeError(f"sink_rope must return a {dtype} tensor of x's shape "
                            f"{tuple(x.shape)}, got {getattr(out, 'dtype', type(out).__name__)} "
                            f"{tuple(getattr(out, 'shape', ()))}")
        tol = {"rtol": 1e-2, "atol": 1e-2}
        if not torch.allclose(out[:, :, 0], x[:, :, 0], **tol) or not torch.allclose(
                out[:, :, 1].norm(), x[:, :, 1].norm(), **tol) or torch.allclose(
                out[:, :, 1], x[:, :, 1], **tol):
            raise ValueError("sink_rope is not a rotation by position: f(x, 0) must return x, "
                             "f(x, 1) turn x and keep its norm")
    return rope


SINK_CONVENTIONS = ("absolute", "cache")  # how sink keys are scored: their own positions, or
# StreamingLLM's positions inside the cache (``RingKVCache``'s ``sink_rope`` is the rotation)


def check_sinks(sinks: object, sink_convention: object) -> int:
    """``sinks`` as an int if ``(sinks, sink_convention)`` is a valid choice; raise otherwise.

    What ``RingRunner``, ``ringviz.hf.RingCache`` and ``generate`` accept: ``sinks`` an int >= 0,
    ``sink_convention`` one of :data:`SINK_CONVENTIONS`, ``"cache"`` only with ``sinks >= 1``.

    >>> check_sinks(2, "cache")
    2
    >>> check_sinks(0, "cache")
    Traceback (most recent call last):
    ValueError: sink_convention='cache' turns sink keys: it needs sinks >= 1
    """
    sinks = check_int("sinks", sinks, minimum=0)
    if sink_convention not in SINK_CONVENTIONS:
        raise ValueError(f"sink_convention must be one of {SINK_CONVENTIONS}, got "
                         f"{sink_convention!r}")
    if sink_convention == "cache" and sinks == 0:
        raise ValueError("sink_convention='cache' turns sink keys: it needs sinks >= 1")
    return sinks
