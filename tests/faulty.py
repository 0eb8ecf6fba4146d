"""A model factory with injectable faults, for tests only (never in product code).

``make_faulty(fault=..., after=N)``: a small deterministic model, y = x @ (gain * W) + 1 over
[N, 8] inputs (``gain`` 1 unless given: new weights for a new version), that misbehaves in one chosen way once it has served ``after`` calls *in this process*
(so a retried request on a fresh worker succeeds). With ``once=PATH`` only the first process to
create the file PATH misbehaves (its siblings and successors behave), so a retried request never
meets a second armed worker: a test of the retry then cannot turn into a test of POISON by chance.
Faults:

  none        behaves
  raise       raises ValueError when the input holds the marker value 13.0
  oom         raises torch.OutOfMemoryError when the input holds the marker value 13.0
  poison      SIGKILLs its own process when the input holds the marker 13.0 (kills every worker),
              ``delay`` seconds into the forward
  segfault    faulthandler._sigsegv() in forward
  exit0       os._exit(0) in forward
  hang        never returns from forward (only on batch size ``only_batch`` if given)
  slow        takes ``delay`` seconds more in forward (only on batch size ``only_batch`` if given)
  leak        keeps ``leak_mb`` MiB more resident memory on every call
  drift       perturbs its weights by ``scale`` (outputs drift from golden)
  flaky_drift perturbed outputs on every other call
  nan         returns NaN
  load_error  raises while loading (the worker exits with code 4); with ``while_exists=PATH``
              only while the file PATH exists (a transient fault a test clears)
  load_hang   never returns from loading (the worker never reports READY)
  garble_link writes what is no frame (a message of 0 parts) on its worker's link, the
              descriptor a model's code can find in its own process, then answers

``load_delay=S`` makes loading take S seconds more, whatever the fault (a big model's load).
``helper_thread=True`` starts an idle thread at load, as many libraries do (a tokenizer's pool,
a data loader): a worker's threads are then more than its serving loop.
"""

from __future__ import annotations

import faulthandler
import os
import signal
import socket
import threading

import torch
from torch import nn

MARKER = 13.0


def weights(features: int = 8) -> torch.Tensor:
    generator = torch.Generator().manual_seed(1234)
    return torch.randn(features, features, generator=generator) * 0.2


def reference(x: torch.Tensor) -> torch.Tensor:
    """What a healthy model returns: tests compare against this in-process."""
    return x @ weights(x.shape[-1]) + 1.0


class Faulty(nn.Module):
    def __init__(self, fault: str, after: int, only_batch: int | None, leak_mb: int,
                 scale: float, delay: float = 0.0, once: str | None = None,
                 gain: float = 1.0) -> None:
        super().__init__()
        self.once = once
        self.claimed: bool | None = None  # None: the token was not tried yet
        self.fault = fault
        self.delay = delay
        self.after = after
        self.only_batch = only_batch
        self.leak_mb = leak_mb
        self.scale = scale
        self.calls = 0
        self.hoard: list[bytearray] = []
        self.register_buffer("weight", weights() * gain)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        armed = self.calls > self.after and (self.only_batch is None or x.shape[0] == self.only_batch)
        armed = armed and self._holds_the_token()
        has_marker = bool((x == MARKER).any())
        if self.fault == "raise" and has_marker:
            raise ValueError("the input holds the marker value")
        if self.fault == "oom" and has_marker:
            raise torch.OutOfMemoryError("the input holds the marker value (test OOM)")
        if self.fault == "poison" and has_marker:
            threading.Event().wait(self.delay)  # a forward this long, not a sync point
            os.kill(os.getpid(), signal.SIGKILL)
        if armed:
            self._misbehave()
        y = x @ self.weight + 1.0
        if armed and self.fault == "nan":
            y = torch.full_like(y, float("nan"))
        if self.fault == "flaky_drift" and self.calls > self.after and self.calls % 2 == 0:
            y = y * (1.0 + self.scale)
        return y

    def _holds_the_token(self) -> bool:
        if self.once is None:
            return True
        if self.claimed is None:
            try:
                os.close(os.open(self.once, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600))
                self.claimed = True
            except FileExistsError:
                self.claimed = False
        return self.claimed

    def _misbehave(self) -> None:
        if self.fault == "segfault":
            faulthandler._sigsegv()
        elif self.fault == "exit0":
            os._exit(0)
        elif self.fault == "hang":
            stuck = threading.Event()  # never set: a model stuck in forward never returns
            while True:
                stuck.wait(3600)
        elif self.fault == "slow":
            threading.Event().wait(self.delay)  # a slower forward, not a sync point
        elif self.fault == "leak":
            block = bytearray(self.leak_mb * 1024 * 1024)
            block[::4096] = b"x" * len(block[::4096])  # touch every page: make it resident
            self.hoard.append(block)
        elif self.fault == "garble_link":
            for fd in os.listdir("/proc/self/fd"):
                try:
                    found = socket.socket(fileno=int(fd))
                except OSError:
                    continue
                try:
                    if found.family == socket.AF_UNIX and found.type == socket.SOCK_STREAM:
                        os.write(int(fd), b"\0\0\0\0")
                finally:
                    found.detach()  # the worker's own descriptor: never closed here
        elif self.fault == "drift" and self.calls == self.after + 1:
            with torch.no_grad():
                self.weight.mul_(1.0 + self.scale)


def make_faulty(fault: str = "none", after: int = 0, only_batch: int | None = None,
                leak_mb: int = 32, scale: float = 0.5, delay: float = 0.0,
                once: str | None = None, load_delay: float = 0.0, gain: float = 1.0,
                while_exists: str | None = None, helper_thread: bool = False) -> nn.Module:
    if helper_thread:
        threading.Thread(target=threading.Event().wait, name="model-helper", daemon=True).start()
    if load_delay:
        threading.Event().wait(load_delay)  # a model that takes this long to load, any fault
    if fault == "load_error" and (while_exists is None or os.path.exists(while_exists)):
        raise RuntimeError("this model refuses to load (test fault)")
    if fault == "load_hang":
        stuck = threading.Event()  # never set: a load that never finishes
        while True:
            stuck.wait(3600)
    return Faulty(fault, after, only_batch, leak_mb, scale, delay, once, gain)


class Echo(nn.Module):
    """Returns its inputs in the structure they came in: a tensor, a tuple, or a dict.
    ``copy=True`` returns fresh tensors (the worker then writes them into the out region);
    otherwise the very same tensors (outputs alias the inputs). ``delay`` seconds pass before
    the inputs are read (a window to truncate a segment under the worker)."""

    def __init__(self, copy: bool, delay: float) -> None:
        super().__init__()
        self.copy = copy
        self.delay = delay

    def forward(self, *args, **kwargs):
        if self.delay:
            threading.Event().wait(self.delay)  # a slow model's compute time, not a sync point
        if self.copy:
            args = tuple(arg.clone() for arg in args)
            kwargs = {key: value.clone() for key, value in kwargs.items()}
        if kwargs:
            return kwargs
        return args[0] if len(args) == 1 else args


def make_echo(copy: bool = False, delay: float = 0.0) -> nn.Module:
    return Echo(copy, delay)


GATE = 99.0  # an input holding it waits in forward while the gate file exists
POISON = 666.0  # an input holding it kills its worker


class Pair(nn.Module):
    """Two inputs, two outputs, row by row independent along dim 0, so a batched answer equals
    the unbatched one: ``(a @ W + 1, b * 2 + a.sum(-1))``, as a tuple or a dict (``out``), or
    the inputs themselves (``out="identity"``).
    Row values pick a behaviour: MARKER raises, POISON SIGKILLs the process, GATE blocks while
    the file ``gate`` exists (tests hold the worker busy with it to make requests queue)."""

    def __init__(self, out: str, gate: str | None) -> None:
        super().__init__()
        self.out = out
        self.gate = gate
        self.register_buffer("weight", weights())

    def forward(self, a: torch.Tensor, b: torch.Tensor):
        if self.gate is not None and bool((a == GATE).any()):
            while os.path.exists(self.gate):
                threading.Event().wait(0.005)  # a model busy for as long as the test says
        if bool((a == MARKER).any()):
            raise ValueError("the input holds the marker value")
        if bool((a == POISON).any()):
            os.kill(os.getpid(), signal.SIGKILL)
        if self.out == "identity":
            return a, b  # the very input tensors (in a batch: the joined ones)
        return pair_reference(a, b, self.out, self.weight)


def pair_reference(a: torch.Tensor, b: torch.Tensor, out: str = "tuple",
                   weight: torch.Tensor | None = None):
    weight = weights() if weight is None else weight
    y = a @ weight + 1.0
    z = b * 2.0 + a.sum(-1, keepdim=True)
    return {"y": y, "z": z} if out == "dict" else (y, z)


def make_pair(out: str = "tuple", gate: str | None = None) -> nn.Module:
    return Pair(out, gate)


class WeightWriter(nn.Sequential):
    """modelwarden.examples.make_mlp's layers (the same state dict keys), built empty for a
    weights_file, that adds 1.0 to its first layer's weights, in place, whenever the input holds
    MARKER: a model that writes to a parameter the workers may share."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if bool((x == MARKER).any()):
            self[0].weight.data.add_(1.0)
        return super().forward(x)


def make_weight_writer(in_features: int = 64, hidden: int = 256, out_features: int = 10) -> nn.Module:
    with torch.device("meta"):
        return WeightWriter(nn.Linear(in_features, hidden), nn.ReLU(), nn.Linear(hidden, out_features))
