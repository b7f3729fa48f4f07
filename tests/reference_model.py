"""A float64 NumPy LLaMA / Qwen2 / Qwen3, written from the math and not from the engine.

Qwen3: q_norm / k_norm (an RMSNorm over each head of q and k, before RoPE) and a head_dim that may
differ from hidden_size / heads. Llama 3: the llama3 RoPE scaling of the frequencies.

Parameters are a dict keyed by HF tensor names ("model.layers.0.self_attn.q_proj.weight", ...);
`loss_and_grads` returns the mean cross-entropy over the valid targets (those not -1, as
PyTorch's cross_entropy), optionally with a z-loss term, and the gradient of every parameter.
Its backward is checked against finite differences of its own forward (test_training_semantics).
"""

from __future__ import annotations

import numpy as np


def hf_names(cfg) -> list[str]:
    names = ["model.embed_tokens.weight"]
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        names += [p + "input_layernorm.weight", p + "post_attention_layernorm.weight"]
        for x in ("q", "k", "v"):
            names.append(p + f"self_attn.{x}_proj.weight")
            if cfg.qkv_bias:
                names.append(p + f"self_attn.{x}_proj.bias")
        if cfg.qk_norm:
            names += [p + "self_attn.q_norm.weight", p + "self_attn.k_norm.weight"]
        names += [p + "self_attn.o_proj.weight", p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight",
                  p + "mlp.down_proj.weight"]  # fmt: skip
    names.append("model.norm.weight")
    if not cfg.tied_embeddings:
        names.append("lm_head.weight")
    return names


def _rms(x, w, eps):
    r = 1.0 / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)
    return x * r * w, r


def _rms_bwd(dy, x, w, r):
    g = dy * w
    dx = r * g - x * r**3 * np.mean(g * x, axis=-1, keepdims=True)
    dw = np.sum(dy * x * r, axis=tuple(range(dy.ndim - 1)))
    return dx, dw


def _llama3(inv, scaling):
    """Meta's Llama 3.1 `apply_scaling`, frequency by frequency."""
    factor, lo, hi = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    old = scaling["original_max_position_embeddings"]
    out = np.empty_like(inv)
    for j, freq in enumerate(inv):
        wavelen = 2 * np.pi / freq
        if wavelen < old / hi:  # high frequency: kept
            out[j] = freq
        elif wavelen > old / lo:  # low frequency: stretched by the factor
            out[j] = freq / factor
        else:
            smooth = (old / wavelen - lo) / (hi - lo)
            out[j] = (1 - smooth) * freq / factor + smooth * freq
    return out


def _rope_tables(T, hs, theta, scaling=None):
    inv = 1.0 / theta ** (np.arange(0, hs, 2, dtype=np.float64) / hs)
    if scaling is not None:
        inv = _llama3(inv, scaling)
    f = np.outer(np.arange(T, dtype=np.float64), inv)  # (T, hs/2)
    emb = np.concatenate([f, f], axis=-1)
    return np.cos(emb)[None, :, None, :], np.sin(emb)[None, :, None, :]


def _rot(x):  # HF rotate_half
    h = x.shape[-1] // 2
    return np.concatenate([-x[..., h:], x[..., :h]], axis=-1)


def _rot_t(y):  # the transpose of _rot
    h = y.shape[-1] // 2
    return np.concatenate([y[..., h:], -y[..., :h]], axis=-1)


def _silu(x):
    return x / (1.0 + np.exp(-x))


def loss_and_grads(cfg, params: dict, inputs, targets, with_grads=True, z_loss=0.0, valid_tokens=None):
    """Loss (float), {HF name: float64 gradient} and the logits; `params` maps HF names to arrays.

    loss = sum over valid targets of (lse - logit[target] + z_loss * lse^2) / valid_tokens, where
    valid_tokens defaults to the number of valid targets here (pass the count of a whole
    accumulated batch to get this micro-batch's share of its mean)."""
    P = {k: np.asarray(v, np.float64) for k, v in params.items()}
    B, T = inputs.shape
    C, Hq, Hkv, hs, eps = cfg.hidden_size, cfg.num_q_heads, cfg.num_kv_heads, cfg.head_size, cfg.rms_norm_eps
    rep = Hq // Hkv
    cos, sin = _rope_tables(T, hs, cfg.rope_theta, cfg.rope_scaling)
    A = Hq * hs  # the attention output's width (o_proj's input)
    mask = np.triu(np.ones((T, T), bool), 1)
    wte = P["model.embed_tokens.weight"]
    head = wte if cfg.tied_embeddings else P["lm_head.weight"]

    x = wte[inputs]
    saved = []
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        s = {"x": x}
        h, s["r1"] = _rms(x, P[p + "input_layernorm.weight"], eps)
        s["h"] = h
        proj = {}
        for n in "qkv":
            y = h @ P[p + f"self_attn.{n}_proj.weight"].T
            if cfg.qkv_bias:
                y = y + P[p + f"self_attn.{n}_proj.bias"]
            proj[n] = y.reshape(B, T, -1, hs)
        if cfg.qk_norm:  # per head, over its hs channels
            s["q0"], s["k0"] = proj["q"], proj["k"]
            proj["q"], s["rq"] = _rms(proj["q"], P[p + "self_attn.q_norm.weight"], eps)
            proj["k"], s["rk"] = _rms(proj["k"], P[p + "self_attn.k_norm.weight"], eps)
        q = proj["q"] * cos + _rot(proj["q"]) * sin
        k = proj["k"] * cos + _rot(proj["k"]) * sin
        v = proj["v"]
        kr, vr = np.repeat(k, rep, axis=2), np.repeat(v, rep, axis=2)  # (B, T, Hq, hs)
        sc = np.einsum("bthd,bshd->bhts", q, kr) / np.sqrt(hs)
        sc = np.where(mask, -np.inf, sc)
        pr = np.exp(sc - sc.max(-1, keepdims=True))
        pr /= pr.sum(-1, keepdims=True)
        att = np.einsum("bhts,bshd->bthd", pr, vr).reshape(B, T, A)
        s.update(q=q, kr=kr, vr=vr, pr=pr, att=att)
        x = x + att @ P[p + "self_attn.o_proj.weight"].T
        s["x2"] = x
        h2, s["r2"] = _rms(x, P[p + "post_attention_layernorm.weight"], eps)
        g = h2 @ P[p + "mlp.gate_proj.weight"].T
        u = h2 @ P[p + "mlp.up_proj.weight"].T
        sw = _silu(g) * u
        s.update(h2=h2, g=g, u=u, sw=sw)
        x = x + sw @ P[p + "mlp.down_proj.weight"].T
        saved.append(s)
    xf, rf = _rms(x, P["model.norm.weight"], eps)
    logits = xf @ head.T  # (B, T, V)
    m = logits.max(-1, keepdims=True)
    lse = (m + np.log(np.exp(logits - m).sum(-1, keepdims=True)))[..., 0]
    valid = targets >= 0
    n = int(np.count_nonzero(valid)) if valid_tokens is None else valid_tokens
    tgt = np.where(valid, targets, 0)
    picked = np.take_along_axis(logits, tgt[..., None], -1)[..., 0]
    loss = float(np.sum(np.where(valid, lse - picked + z_loss * lse * lse, 0.0)) / n)
    if not with_grads:
        return loss, None, logits

    G = {k: np.zeros_like(v) for k, v in P.items()}
    dlog = np.exp(logits - lse[..., None]) * (1.0 + 2.0 * z_loss * lse[..., None])
    np.put_along_axis(dlog, tgt[..., None], np.take_along_axis(dlog, tgt[..., None], -1) - 1.0, -1)
    dlog *= (valid / n)[..., None]
    dhead = np.einsum("btv,btc->vc", dlog, xf)
    dxf = dlog @ head
    dx, G["model.norm.weight"] = _rms_bwd(dxf, x, P["model.norm.weight"], rf)
    for i in reversed(range(cfg.num_layers)):
        p, s = f"model.layers.{i}.", saved[i]
        # MLP
        G[p + "mlp.down_proj.weight"] = np.einsum("btc,bth->ch", dx, s["sw"])
        dsw = dx @ P[p + "mlp.down_proj.weight"]
        sig = 1.0 / (1.0 + np.exp(-s["g"]))
        dg = dsw * s["u"] * sig * (1.0 + s["g"] * (1.0 - sig))
        du = dsw * _silu(s["g"])
        G[p + "mlp.gate_proj.weight"] = np.einsum("bth,btc->hc", dg, s["h2"])
        G[p + "mlp.up_proj.weight"] = np.einsum("bth,btc->hc", du, s["h2"])
        dh2 = dg @ P[p + "mlp.gate_proj.weight"] + du @ P[p + "mlp.up_proj.weight"]
        d, G[p + "post_attention_layernorm.weight"] = _rms_bwd(dh2, s["x2"], P[p + "post_attention_layernorm.weight"],
                                                             s["r2"])  # fmt: skip
        dx = dx + d
        # attention
        G[p + "self_attn.o_proj.weight"] = np.einsum("btc,btd->cd", dx, s["att"])
        datt = (dx @ P[p + "self_attn.o_proj.weight"]).reshape(B, T, Hq, hs)
        pr = s["pr"]
        dpr = np.einsum("bthd,bshd->bhts", datt, s["vr"])
        dvr = np.einsum("bhts,bthd->bshd", pr, datt)
        dsc = pr * (dpr - np.sum(dpr * pr, -1, keepdims=True)) / np.sqrt(hs)
        dq = np.einsum("bhts,bshd->bthd", dsc, s["kr"])
        dkr = np.einsum("bhts,bthd->bshd", dsc, s["q"])
        dk = dkr.reshape(B, T, Hkv, rep, hs).sum(3)
        dv = dvr.reshape(B, T, Hkv, rep, hs).sum(3)
        dq = dq * cos + _rot_t(dq * sin)
        dk = dk * cos + _rot_t(dk * sin)
        if cfg.qk_norm:
            dq, G[p + "self_attn.q_norm.weight"] = _rms_bwd(dq, s["q0"], P[p + "self_attn.q_norm.weight"], s["rq"])
            dk, G[p + "self_attn.k_norm.weight"] = _rms_bwd(dk, s["k0"], P[p + "self_attn.k_norm.weight"], s["rk"])
        dh = 0.0
        for n, dy in (("q", dq), ("k", dk), ("v", dv)):
            dy = dy.reshape(B, T, -1)
            G[p + f"self_attn.{n}_proj.weight"] = np.einsum("bto,btc->oc", dy, s["h"])
            if cfg.qkv_bias:
                G[p + f"self_attn.{n}_proj.bias"] = dy.sum((0, 1))
            dh = dh + dy @ P[p + f"self_attn.{n}_proj.weight"]
        d, G[p + "input_layernorm.weight"] = _rms_bwd(dh, s["x"], P[p + "input_layernorm.weight"], s["r1"])
        dx = dx + d
    dwte = np.zeros_like(wte)
    np.add.at(dwte, inputs.reshape(-1), dx.reshape(-1, C))
    if cfg.tied_embeddings:
        dwte += dhead
    else:
        G["lm_head.weight"] = dhead
    G["model.embed_tokens.weight"] = dwte
    return loss, G, logits
