#!/usr/bin/python3
"""Generate reference optimizer trajectories and learning-rate schedule values
for the psx optimizer tests.

Run with Debian's python (``/usr/bin/python3``) and Debian's PyTorch CPU build
(``apt-get install python3-torch python3-numpy``, torch 1.13.1).  Writes
``trajectories.txt`` next to this script.  The output is deterministic.

Random numbers come from splitmix64 so that the C++ tests can reproduce the
exact same initial parameters and gradients bit for bit:

    state += 0x9E3779B97F4A7C15
    z = state
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9
    z = (z ^ (z >> 27)) * 0x94D049BB133111EB
    return z ^ (z >> 31)                      (all mod 2^64)

    uniform(x) = float32((x >> 40) * 2**-24 * 2 - 1)   in [-1, 1), exact

Dense case (n = 16): n initial parameters, then n gradients per step.
Sparse case (10 x 4 table): 40 initial values row-major, then per step 5 ids
(next() % 10, duplicates allowed) followed by 5*4 gradient values row-major.
Seed of optimizer case c (0-based) is 1000 + c.

File format (see the psx optimizer tests):
    # header
    case <name> <dense|sparse> size=<n> steps=200 seed=<seed> <key=value ...>
    <200 lines: parameter values after each step, %.9e, space separated>
    end
    schedule <name> steps=200 <key=value ...>
    <one line: 200 factors, %.17g, space separated>
    end
"""

import math
import os
import sys

import numpy as np
import torch

STEPS = 200
DENSE_N = 16
ROWS, WIDTH = 10, 4
SPARSE_IDS = 5
MASK64 = (1 << 64) - 1
F32 = np.float32

torch.set_num_threads(1)
torch.manual_seed(0)  # not used, but keeps torch from depending on anything


# --------------------------------------------------------------------------
# random numbers

class SplitMix64:
    def __init__(self, seed):
        self.state = seed & MASK64

    def next(self):
        self.state = (self.state + 0x9E3779B97F4A7C15) & MASK64
        z = self.state
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK64
        return z ^ (z >> 31)

    def uniform(self):
        v = (self.next() >> 40) * 2.0 ** -24 * 2 - 1
        f = F32(v)
        assert float(f) == v and -1.0 <= v < 1.0
        return f


def dense_stream(seed):
    """Returns (p0 float32[16], list of 200 float32[16] gradients)."""
    rng = SplitMix64(seed)
    p0 = np.array([rng.uniform() for _ in range(DENSE_N)], dtype=F32)
    grads = [np.array([rng.uniform() for _ in range(DENSE_N)], dtype=F32)
             for _ in range(STEPS)]
    return p0, grads


def sparse_stream(seed):
    """Returns (p0 float32[10,4], list of 200 (ids int64[5], vals float32[5,4]))."""
    rng = SplitMix64(seed)
    p0 = np.array([rng.uniform() for _ in range(ROWS * WIDTH)],
                  dtype=F32).reshape(ROWS, WIDTH)
    steps = []
    for _ in range(STEPS):
        ids = np.array([rng.next() % ROWS for _ in range(SPARSE_IDS)], dtype=np.int64)
        vals = np.array([rng.uniform() for _ in range(SPARSE_IDS * WIDTH)],
                        dtype=F32).reshape(SPARSE_IDS, WIDTH)
        steps.append((ids, vals))
    return p0, steps


def coalesce_np(ids, vals, dtype):
    """Sum duplicate ids' rows (in order of appearance); returns sorted ids, rows."""
    out = {}
    for j, i in enumerate(ids):
        i = int(i)
        if i in out:
            out[i] = (out[i] + vals[j].astype(dtype)).astype(dtype)
        else:
            out[i] = vals[j].astype(dtype).copy()
    keys = sorted(out)
    return keys, [out[k] for k in keys]


# --------------------------------------------------------------------------
# torch-driven trajectories

def run_torch_dense(seed, make_opt):
    p0, grads = dense_stream(seed)
    param = torch.nn.Parameter(torch.tensor(p0, dtype=torch.float32))
    opt = make_opt([param])
    traj = []
    for g in grads:
        param.grad = torch.tensor(g, dtype=torch.float32)
        opt.step()
        traj.append(param.detach().numpy().astype(F32).copy())
    return p0, grads, traj


def run_torch_sparse(seed, make_opt):
    p0, steps = sparse_stream(seed)
    param = torch.nn.Parameter(torch.tensor(p0, dtype=torch.float32))
    opt = make_opt([param])
    traj = []
    for ids, vals in steps:
        param.grad = torch.sparse_coo_tensor(
            torch.tensor(ids, dtype=torch.int64).reshape(1, SPARSE_IDS),
            torch.tensor(vals, dtype=torch.float32),
            (ROWS, WIDTH))
        opt.step()
        traj.append(param.detach().numpy().astype(F32).reshape(-1).copy())
    return p0, steps, traj


# --------------------------------------------------------------------------
# formula optimizers (numpy float32, no torch counterpart)

def ftrl_update(w, accum, linear, g, lr, lr_power, l1, l2, dt):
    """One FTRL-Proximal step (tf.raw_ops.ApplyFtrlV2, l2_shrinkage = 0).
    Works on arrays of dtype dt; scalars are cast to dt.  For lr_power == -0.5
    TensorFlow uses sqrt instead of pow; so do we (sqrt is exactly rounded)."""
    lr_ = dt(lr)
    l1_ = dt(l1)
    two_l2 = dt(2 * l2)

    def powf(x):
        if lr_power == -0.5:
            return np.sqrt(x)
        return np.power(x, dt(-lr_power))

    accum_new = (accum + g * g).astype(dt)
    sigma = ((powf(accum_new) - powf(accum)) / lr_).astype(dt)
    linear = (linear + (g - sigma * w)).astype(dt)  # TF: linear += grad - sigma * var
    quadratic = (powf(accum_new) / lr_ + two_l2).astype(dt)
    w = np.where(np.abs(linear) > l1_,
                 (np.sign(linear) * l1_ - linear) / quadratic,
                 dt(0)).astype(dt)
    return w, accum_new, linear


def run_ftrl_dense(seed, hp, dt=F32):
    p0, grads = dense_stream(seed)
    w = p0.astype(dt)
    accum = np.full(DENSE_N, hp["initial_accumulator_value"], dtype=dt)
    linear = np.zeros(DENSE_N, dtype=dt)
    traj = []
    for g in grads:
        w, accum, linear = ftrl_update(w, accum, linear, g.astype(dt), hp["lr"],
                                       hp["lr_power"], hp["l1"], hp["l2"], dt)
        traj.append(w.astype(F32).copy())
    return traj


def run_ftrl_sparse(seed, hp, dt=F32):
    p0, steps = sparse_stream(seed)
    w = p0.astype(dt)
    accum = np.full((ROWS, WIDTH), hp["initial_accumulator_value"], dtype=dt)
    linear = np.zeros((ROWS, WIDTH), dtype=dt)
    traj = []
    for ids, vals in steps:
        keys, rows = coalesce_np(ids, vals, dt)
        for i, g in zip(keys, rows):
            w[i], accum[i], linear[i] = ftrl_update(
                w[i], accum[i], linear[i], g, hp["lr"], hp["lr_power"],
                hp["l1"], hp["l2"], dt)
        traj.append(w.astype(F32).reshape(-1).copy())
    return traj


def run_lamb(seed, hp, dt=F32):
    """TensorFlow Addons LAMB, one layer = the whole vector.  The two norms are
    accumulated in float64 and rounded to dt (order-independent up to that
    rounding); everything else is dt arithmetic."""
    p0, grads = dense_stream(seed)
    lr, b1, b2, eps, wd = hp["lr"], hp["beta1"], hp["beta2"], hp["eps"], hp["weight_decay"]
    w = p0.astype(dt)
    m = np.zeros(DENSE_N, dtype=dt)
    v = np.zeros(DENSE_N, dtype=dt)
    traj = []
    for t, g in enumerate(grads, start=1):
        g = g.astype(dt)
        m = (dt(b1) * m + dt(1 - b1) * g).astype(dt)
        v = (dt(b2) * v + dt(1 - b2) * g * g).astype(dt)
        m_hat = (m / dt(1 - b1 ** t)).astype(dt)
        v_hat = (v / dt(1 - b2 ** t)).astype(dt)
        r = (m_hat / (np.sqrt(v_hat) + dt(eps)) + dt(wd) * w).astype(dt)
        w_norm = dt(math.sqrt(float(np.sum(w.astype(np.float64) ** 2))))
        r_norm = dt(math.sqrt(float(np.sum(r.astype(np.float64) ** 2))))
        ratio = dt(w_norm / r_norm) if (w_norm > 0 and r_norm > 0) else dt(1)
        w = (w - dt(lr) * ratio * r).astype(dt)
        traj.append(w.astype(F32).copy())
    return traj


# --------------------------------------------------------------------------
# independent float64 re-implementations of torch cases (cross-checks only)

def ref_sgd(seed, lr, momentum=0.0, dampening=0.0, weight_decay=0.0, nesterov=False):
    p0, grads = dense_stream(seed)
    p = p0.astype(np.float64)
    buf = None
    out = []
    for g in grads:
        d = g.astype(np.float64) + weight_decay * p
        if momentum != 0:
            buf = d.copy() if buf is None else momentum * buf + (1 - dampening) * d
            d = d + momentum * buf if nesterov else buf
        p = p - lr * d
        out.append(p.copy())
    return out


def ref_adagrad(seed, lr, lr_decay=0.0, weight_decay=0.0, iav=0.0, eps=1e-10):
    p0, grads = dense_stream(seed)
    p = p0.astype(np.float64)
    s = np.full_like(p, iav)
    out = []
    for t, g in enumerate(grads, start=1):
        g = g.astype(np.float64) + weight_decay * p
        clr = lr / (1 + (t - 1) * lr_decay)
        s = s + g * g
        p = p - clr * g / (np.sqrt(s) + eps)
        out.append(p.copy())
    return out


def ref_rmsprop(seed, lr, alpha, eps, weight_decay=0.0, momentum=0.0, centered=False):
    p0, grads = dense_stream(seed)
    p = p0.astype(np.float64)
    sq = np.zeros_like(p)
    ga = np.zeros_like(p)
    buf = np.zeros_like(p)
    out = []
    for g in grads:
        g = g.astype(np.float64) + weight_decay * p
        sq = alpha * sq + (1 - alpha) * g * g
        if centered:
            ga = alpha * ga + (1 - alpha) * g
            avg = np.sqrt(sq - ga * ga) + eps
        else:
            avg = np.sqrt(sq) + eps
        if momentum > 0:
            buf = momentum * buf + g / avg
            p = p - lr * buf
        else:
            p = p - lr * g / avg
        out.append(p.copy())
    return out


def ref_adam(seed, lr, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0,
             amsgrad=False, decoupled=False):
    p0, grads = dense_stream(seed)
    p = p0.astype(np.float64)
    m = np.zeros_like(p)
    v = np.zeros_like(p)
    vmax = np.zeros_like(p)
    out = []
    for t, g in enumerate(grads, start=1):
        g = g.astype(np.float64)
        if decoupled:
            p = p * (1 - lr * weight_decay)
        else:
            g = g + weight_decay * p
        m = beta1 * m + (1 - beta1) * g
        v = beta2 * v + (1 - beta2) * g * g
        bc1 = 1 - beta1 ** t
        bc2 = 1 - beta2 ** t
        if amsgrad:
            vmax = np.maximum(vmax, v)
            denom = np.sqrt(vmax) / math.sqrt(bc2) + eps
        else:
            denom = np.sqrt(v) / math.sqrt(bc2) + eps
        p = p - (lr / bc1) * m / denom
        out.append(p.copy())
    return out


def ref_sparse(seed, kind, lr, beta1=0.9, beta2=0.999, eps=1e-8):
    p0, steps = sparse_stream(seed)
    p = p0.astype(np.float64)
    a = np.zeros_like(p)  # exp_avg or adagrad sum
    b = np.zeros_like(p)
    out = []
    for t, (ids, vals) in enumerate(steps, start=1):
        keys, rows = coalesce_np(ids, vals, np.float64)
        for i, g in zip(keys, rows):
            if kind == "sgd":
                p[i] -= lr * g
            elif kind == "adagrad":
                a[i] += g * g
                p[i] -= lr * g / (np.sqrt(a[i]) + 1e-10)
            elif kind == "adam":
                a[i] = beta1 * a[i] + (1 - beta1) * g
                b[i] = beta2 * b[i] + (1 - beta2) * g * g
                step_size = lr * math.sqrt(1 - beta2 ** t) / (1 - beta1 ** t)
                p[i] -= step_size * a[i] / (np.sqrt(b[i]) + eps)
        out.append(p.reshape(-1).copy())
    return out


def assert_close(name, got, ref, rtol=1e-4, atol=1e-6):
    got = np.array(got, dtype=np.float64)
    ref = np.array(ref, dtype=np.float64)
    err = np.abs(got - ref)
    tol = atol + rtol * np.abs(ref)
    worst = float(np.max(err / tol))
    print(f"  check {name}: max |diff| = {float(np.max(err)):.3e}, "
          f"max diff/tol = {worst:.3f}")
    assert np.all(err <= tol), f"cross-check failed for {name}"


# --------------------------------------------------------------------------
# case table

def sgd_hp(lr, momentum=0.0, dampening=0.0, nesterov=False, weight_decay=0.0):
    return dict(lr=lr, momentum=momentum, dampening=dampening,
                nesterov=nesterov, weight_decay=weight_decay)


def adagrad_hp(lr, lr_decay=0.0, weight_decay=0.0, initial_accumulator_value=0.0,
               eps=1e-10):
    return dict(lr=lr, lr_decay=lr_decay, weight_decay=weight_decay,
                initial_accumulator_value=initial_accumulator_value, eps=eps)


def rmsprop_hp(lr, alpha=0.99, eps=1e-8, weight_decay=0.0, momentum=0.0,
               centered=False):
    return dict(lr=lr, alpha=alpha, eps=eps, weight_decay=weight_decay,
                momentum=momentum, centered=centered)


def adam_hp(lr, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, amsgrad=False):
    return dict(lr=lr, beta1=beta1, beta2=beta2, eps=eps,
                weight_decay=weight_decay, amsgrad=amsgrad)


def torch_sgd(hp):
    return lambda ps: torch.optim.SGD(ps, lr=hp["lr"], momentum=hp["momentum"],
                                      dampening=hp["dampening"],
                                      weight_decay=hp["weight_decay"],
                                      nesterov=hp["nesterov"], foreach=False)


def torch_adagrad(hp):
    return lambda ps: torch.optim.Adagrad(
        ps, lr=hp["lr"], lr_decay=hp["lr_decay"], weight_decay=hp["weight_decay"],
        initial_accumulator_value=hp["initial_accumulator_value"], eps=hp["eps"],
        foreach=False)


def torch_rmsprop(hp):
    return lambda ps: torch.optim.RMSprop(
        ps, lr=hp["lr"], alpha=hp["alpha"], eps=hp["eps"],
        weight_decay=hp["weight_decay"], momentum=hp["momentum"],
        centered=hp["centered"], foreach=False)


def torch_adam(hp):
    return lambda ps: torch.optim.Adam(
        ps, lr=hp["lr"], betas=(hp["beta1"], hp["beta2"]), eps=hp["eps"],
        weight_decay=hp["weight_decay"], amsgrad=hp["amsgrad"], foreach=False)


def torch_adamw(hp):
    return lambda ps: torch.optim.AdamW(
        ps, lr=hp["lr"], betas=(hp["beta1"], hp["beta2"]), eps=hp["eps"],
        weight_decay=hp["weight_decay"], amsgrad=hp["amsgrad"], foreach=False)


def torch_sparse_adam(hp):
    return lambda ps: torch.optim.SparseAdam(
        ps, lr=hp["lr"], betas=(hp["beta1"], hp["beta2"]), eps=hp["eps"])


# (name, dense|sparse, hyper-parameters, kind, factory-or-None)
CASES = [
    ("sgd", "dense", sgd_hp(0.1), "torch", torch_sgd),
    ("sgd_momentum", "dense", sgd_hp(0.05, momentum=0.9), "torch", torch_sgd),
    ("sgd_nesterov", "dense", sgd_hp(0.05, momentum=0.9, nesterov=True), "torch", torch_sgd),
    ("sgd_dampening_wd", "dense",
     sgd_hp(0.05, momentum=0.9, dampening=0.1, weight_decay=0.01), "torch", torch_sgd),
    ("adagrad", "dense", adagrad_hp(0.1), "torch", torch_adagrad),
    ("adagrad_decay", "dense",
     adagrad_hp(0.1, lr_decay=0.01, weight_decay=0.01, initial_accumulator_value=0.1,
                eps=1e-10), "torch", torch_adagrad),
    ("rmsprop", "dense", rmsprop_hp(0.01, alpha=0.99, eps=1e-8), "torch", torch_rmsprop),
    ("rmsprop_centered", "dense",
     rmsprop_hp(0.01, alpha=0.9, eps=1e-8, centered=True, momentum=0.5, weight_decay=0.01),
     "torch", torch_rmsprop),
    ("adam", "dense", adam_hp(0.01), "torch", torch_adam),
    ("adam_amsgrad_wd", "dense", adam_hp(0.01, amsgrad=True, weight_decay=0.01),
     "torch", torch_adam),
    ("adamw", "dense", adam_hp(0.01, weight_decay=0.01), "torch", torch_adamw),
    ("adamw_amsgrad", "dense", adam_hp(0.01, weight_decay=0.1, amsgrad=True),
     "torch", torch_adamw),
    ("ftrl", "dense",
     dict(lr=0.1, lr_power=-0.5, l1=0.01, l2=0.01, initial_accumulator_value=0.1),
     "ftrl", None),
    ("ftrl_power", "dense",
     dict(lr=0.05, lr_power=-0.6, l1=0.001, l2=0.0, initial_accumulator_value=0.1),
     "ftrl", None),
    ("lamb", "dense",
     dict(lr=0.01, beta1=0.9, beta2=0.999, eps=1e-6, weight_decay=0.01), "lamb", None),
    ("sparse_adam", "sparse", dict(lr=0.01, beta1=0.9, beta2=0.999, eps=1e-8),
     "torch", torch_sparse_adam),
    ("sparse_adagrad", "sparse", adagrad_hp(0.1), "torch", torch_adagrad),
    ("sparse_sgd", "sparse", sgd_hp(0.1), "torch", torch_sgd),
    ("sparse_ftrl", "sparse",
     dict(lr=0.1, lr_power=-0.5, l1=0.01, l2=0.01, initial_accumulator_value=0.1),
     "ftrl", None),
]


def fmt_value(v):
    if isinstance(v, bool):
        return "1" if v else "0"
    return repr(float(v))


def run_case(index, name, layout, hp, kind, factory):
    seed = 1000 + index
    if kind == "torch":
        if layout == "dense":
            _, _, traj = run_torch_dense(seed, factory(hp))
        else:
            _, _, traj = run_torch_sparse(seed, factory(hp))
    elif kind == "ftrl":
        traj = (run_ftrl_dense if layout == "dense" else run_ftrl_sparse)(seed, hp)
    elif kind == "lamb":
        traj = run_lamb(seed, hp)
    else:
        raise ValueError(kind)
    return seed, traj


def cross_check(index, name, traj):
    seed = 1000 + index
    hp = CASES[index][2]
    if name.startswith("sgd"):
        ref = ref_sgd(seed, hp["lr"], hp["momentum"], hp["dampening"],
                      hp["weight_decay"], hp["nesterov"])
    elif name.startswith("adagrad"):
        ref = ref_adagrad(seed, hp["lr"], hp["lr_decay"], hp["weight_decay"],
                          hp["initial_accumulator_value"], hp["eps"])
    elif name.startswith("rmsprop"):
        ref = ref_rmsprop(seed, hp["lr"], hp["alpha"], hp["eps"], hp["weight_decay"],
                          hp["momentum"], hp["centered"])
    elif name.startswith("adam"):
        ref = ref_adam(seed, hp["lr"], hp["beta1"], hp["beta2"], hp["eps"],
                       hp["weight_decay"], hp["amsgrad"],
                       decoupled=name.startswith("adamw"))
    elif name == "sparse_adam":
        ref = ref_sparse(seed, "adam", hp["lr"], hp["beta1"], hp["beta2"], hp["eps"])
    elif name == "sparse_adagrad":
        ref = ref_sparse(seed, "adagrad", hp["lr"])
    elif name == "sparse_sgd":
        ref = ref_sparse(seed, "sgd", hp["lr"])
    elif name.startswith("ftrl"):
        ref = run_ftrl_dense(seed, hp, dt=np.float64)
    elif name == "sparse_ftrl":
        ref = run_ftrl_sparse(seed, hp, dt=np.float64)
    elif name == "lamb":
        ref = run_lamb(seed, hp, dt=np.float64)
    else:
        return
    assert_close(name, traj, ref)


# --------------------------------------------------------------------------
# schedules (float64, TensorFlow formulas)

def cosine_factor(t, decay_steps, alpha):
    s = min(t, decay_steps)
    c = 0.5 * (1 + math.cos(math.pi * s / decay_steps))
    return (1 - alpha) * c + alpha


SCHEDULES = [
    ("exponential", "decay_rate=0.5 decay_steps=50 staircase=0",
     lambda t: 0.5 ** (t / 50)),
    ("exponential_staircase", "decay_rate=0.5 decay_steps=50 staircase=1",
     lambda t: 0.5 ** math.floor(t / 50)),
    ("polynomial", "decay_steps=150 end=0.1 power=2",
     lambda t: (1 - 0.1) * (1 - min(t, 150) / 150) ** 2 + 0.1),
    ("piecewise", "boundaries=50,120 values=1,0.5,0.1",
     lambda t: 1.0 if t <= 50 else (0.5 if t <= 120 else 0.1)),
    ("cosine", "decay_steps=150 alpha=0.1",
     lambda t: cosine_factor(t, 150, 0.1)),
    ("warmup_cosine", "warmup=20 decay_steps=150 alpha=0",
     lambda t: t / 20 if t < 20 else cosine_factor(t - 20, 150, 0.0)),
]


def torch_schedule(make_sched, steps=STEPS):
    p = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([p], lr=1.0)
    sched = make_sched(opt)
    out = []
    for _ in range(steps):
        out.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    return out


def check_schedules(values):
    ls = torch.optim.lr_scheduler

    def cmp(name, got, ref, idx, rtol=1e-12, atol=1e-15):
        worst = 0.0
        for t in idx:
            d = abs(got[t] - ref[t])
            assert d <= atol + rtol * abs(ref[t]), (name, t, got[t], ref[t])
            worst = max(worst, d)
        print(f"  check schedule {name}: {len(idx)} points, max |diff| = {worst:.3e}")

    all_t = range(STEPS)
    cmp("exponential vs ExponentialLR",
        torch_schedule(lambda o: ls.ExponentialLR(o, gamma=0.5 ** (1 / 50))),
        values["exponential"], all_t, rtol=1e-12)
    cmp("exponential_staircase vs StepLR",
        torch_schedule(lambda o: ls.StepLR(o, step_size=50, gamma=0.5)),
        values["exponential_staircase"], all_t, rtol=0, atol=0)
    # torch's PolynomialLR has no end value: factor = (1 - min(t,T)/T)^power,
    # i.e. TF's with end = 0; compare against (f - end) / (1 - end).
    poly = torch_schedule(lambda o: ls.PolynomialLR(o, total_iters=150, power=2.0))
    cmp("polynomial vs PolynomialLR (end-normalised)", poly,
        [(f - 0.1) / (1 - 0.1) for f in values["polynomial"]], all_t,
        rtol=1e-9, atol=1e-12)
    # torch's CosineAnnealingLR is periodic (rises again after T_max); only the
    # first half-period has the same formula as TF's CosineDecay.
    cmp("cosine vs CosineAnnealingLR (t <= 150)",
        torch_schedule(lambda o: ls.CosineAnnealingLR(o, T_max=150, eta_min=0.1)),
        values["cosine"], range(151), rtol=1e-9, atol=1e-12)
    cos0 = torch_schedule(lambda o: ls.CosineAnnealingLR(o, T_max=150, eta_min=0.0))
    cmp("warmup_cosine tail vs CosineAnnealingLR (20 <= t <= 170)",
        [None] * 20 + cos0[:STEPS - 20], values["warmup_cosine"], range(20, 171),
        rtol=1e-9, atol=1e-12)
    # tf PiecewiseConstantDecay switches *after* a boundary (t <= b keeps the
    # old value); torch MultiStepLR switches *at* a milestone.  With milestone
    # 51 and gamma 0.5 the first two pieces match.
    cmp("piecewise vs MultiStepLR(milestones=[51]) (t <= 120)",
        torch_schedule(lambda o: ls.MultiStepLR(o, milestones=[51], gamma=0.5)),
        values["piecewise"], range(121), rtol=0, atol=0)


# --------------------------------------------------------------------------

def torch_version():
    """torch.__version__ of Debian's 1.13.1 build reads '1.13.0a0'; add the
    package version so the header says which release was used."""
    v = torch.__version__
    try:
        import subprocess
        deb = subprocess.run(["dpkg-query", "-W", "-f=${Version}", "python3-torch"],
                             capture_output=True, text=True, check=True).stdout.strip()
        if deb:
            v += f" (Debian python3-torch {deb})"
    except (OSError, subprocess.CalledProcessError):
        pass
    return v


def main():
    here = os.path.dirname(os.path.abspath(__file__))
    out_path = os.path.join(here, "trajectories.txt")
    print(f"torch {torch.__version__}, numpy {np.__version__}, python {sys.version.split()[0]}")

    lines = ["# psx optimizer reference trajectories, generated by "
             "tests/optim/reference/generate.py with torch "
             f"{torch_version()}; do not edit"]

    for index, (name, layout, hp, kind, factory) in enumerate(CASES):
        seed, traj = run_case(index, name, layout, hp, kind, factory)
        size = DENSE_N if layout == "dense" else ROWS * WIDTH
        assert len(traj) == STEPS and all(len(x) == size for x in traj)
        assert all(np.all(np.isfinite(x)) for x in traj), name
        print(f"case {index:2d} {name}: final[0..3] = {traj[-1][:4]}")
        cross_check(index, name, traj)
        kv = " ".join(f"{k}={fmt_value(v)}" for k, v in hp.items())
        lines.append(f"case {name} {layout} size={size} steps={STEPS} seed={seed} {kv}")
        for x in traj:
            lines.append(" ".join("%.9e" % float(v) for v in np.asarray(x, dtype=F32)))
        lines.append("end")

    values = {}
    for name, kv, f in SCHEDULES:
        vals = [float(f(t)) for t in range(STEPS)]
        values[name] = vals
        lines.append(f"schedule {name} steps={STEPS} {kv}")
        lines.append(" ".join("%.17g" % v for v in vals))
        lines.append("end")
    check_schedules(values)

    text = "\n".join(lines) + "\n"
    with open(out_path, "w", newline="\n") as fh:
        fh.write(text)
    print(f"wrote {out_path}: {len(text.encode())} bytes, {len(lines)} lines")


if __name__ == "__main__":
    main()
