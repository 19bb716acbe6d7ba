"""The cuBLAS calls of examples/gpt/gpt_kernels.cu, checked without a GPU.

cuBLAS reads column-major matrices; the GPT's buffers are row-major, so each product in
gpt_kernels.cu is written transposed, with leading dimensions and (for the attention) batch
strides that are easy to get wrong and cannot be run on a machine without a GPU. This script
emulates cublas<t>gemmStridedBatched on flat arrays and makes the same calls, argument for
argument as in gpt_kernels.cu (keep them in step when that file changes), then compares with
numpy's row-major arithmetic: linear forward and backward, the attention forward, and the
attention backward against central differences.

    /usr/bin/python3 tests/reference/check_gpt_cublas_calls.py
"""
import numpy as np

rng = np.random.default_rng(0)

def gemm(ta, tb, m, n, k, alpha, A, a_off, lda, sA, B, b_off, ldb, sB, beta, C, c_off, ldc, sC, count=1):
    for i in range(count):
        def mat(buf, off, ld, rows, cols):  # column-major rows x cols at off with ld
            out = np.empty((rows, cols))
            for c in range(cols):
                out[:, c] = buf[off + c*ld: off + c*ld + rows]
            return out
        # op(A) is m x k: A stored is (m x k) if N else (k x m)
        Am = mat(A, a_off + i*sA, lda, m, k) if ta == 'N' else mat(A, a_off + i*sA, lda, k, m).T
        Bm = mat(B, b_off + i*sB, ldb, k, n) if tb == 'N' else mat(B, b_off + i*sB, ldb, n, k).T
        Cm = mat(C, c_off + i*sC, ldc, m, n)
        R = alpha * Am @ Bm + beta * Cm
        for c in range(n):
            C[c_off + i*sC + c*ldc: c_off + i*sC + c*ldc + m] = R[:, c]

# linear
N, I, O = 5, 4, 3
x = rng.standard_normal((N, I)); W = rng.standard_normal((O, I)); g = rng.standard_normal((N, O))
out = np.zeros(N*O)
gemm('T', 'N', O, N, I, 1, W.ravel(), 0, I, 0, x.ravel(), 0, I, 0, 0, out, 0, O, 0)
assert np.allclose(out.reshape(N, O), x @ W.T)
din = rng.standard_normal(N*I); din0 = din.copy()
gemm('N', 'N', I, N, O, 1, W.ravel(), 0, I, 0, g.ravel(), 0, O, 0, 1, din, 0, I, 0)
assert np.allclose(din.reshape(N, I), din0.reshape(N, I) + g @ W)
dw = rng.standard_normal(O*I); dw0 = dw.copy()
gemm('N', 'T', I, O, N, 1, x.ravel(), 0, I, 0, g.ravel(), 0, O, 0, 1, dw, 0, I, 0)
assert np.allclose(dw.reshape(O, I), dw0.reshape(O, I) + g.T @ x)
print("linear ok")

# attention
B, L, NH, hs = 2, 6, 3, 4
C = NH*hs
qkv = rng.standard_normal((B*L, 3*C)).ravel()
dy = rng.standard_normal((B*L, C)).ravel()
scale = 1/np.sqrt(hs)
att = np.zeros(B*NH*L*L); y = np.zeros(B*L*C)
for b in range(B):
    q = b*L*3*C
    gemm('T', 'N', L, L, hs, scale, qkv, q + C, 3*C, hs, qkv, q, 3*C, hs, 0, att, b*NH*L*L, L, L*L, NH)
def causal_softmax(a):
    a = a.reshape(-1, L).copy()
    for r in range(a.shape[0]):
        t = r % L
        row = a[r, :t+1]; e = np.exp(row - row.max()); a[r, :t+1] = e/e.sum(); a[r, t+1:] = 0
    return a.ravel()
att = causal_softmax(att)
for b in range(B):
    v = b*L*3*C + 2*C
    gemm('N', 'N', hs, L, L, 1, qkv, v, 3*C, hs, att, b*NH*L*L, L, L*L, 0, y, b*L*C, C, hs, NH)
# reference
Q = qkv.reshape(B, L, 3, NH, hs)
ref_att = np.zeros((B, NH, L, L)); ref_y = np.zeros((B, L, NH, hs))
for b in range(B):
    for h in range(NH):
        q, k, v = Q[b, :, 0, h], Q[b, :, 1, h], Q[b, :, 2, h]
        s = q @ k.T * scale
        mask = np.tril(np.ones((L, L)))
        s = np.where(mask > 0, s, -np.inf); e = np.exp(s - s.max(1, keepdims=True)); a = e/e.sum(1, keepdims=True)
        ref_att[b, h] = a; ref_y[b, :, h] = a @ v
assert np.allclose(att, ref_att.ravel()); assert np.allclose(y, ref_y.ravel())
print("attention forward ok")
# backward
dqkv = np.zeros(B*L*3*C); ds = np.zeros(B*NH*L*L)
for b in range(B):
    v = b*L*3*C + 2*C; gg = b*L*C; a = b*NH*L*L
    gemm('N', 'T', hs, L, L, 1, dy, gg, C, hs, att, a, L, L*L, 1, dqkv, b*L*3*C + 2*C, 3*C, hs, NH)
    gemm('T', 'N', L, L, hs, 1, qkv, v, 3*C, hs, dy, gg, C, hs, 0, ds, a, L, L*L, NH)
dsr = ds.reshape(-1, L); atr = att.reshape(-1, L)
for r in range(dsr.shape[0]):
    t = r % L
    w = (atr[r, :t+1]*dsr[r, :t+1]).sum()
    dsr[r] = [atr[r, u]*(dsr[r, u]-w)*scale if u <= t else 0 for u in range(L)]
ds = dsr.ravel()
for b in range(B):
    q = b*L*3*C; d = b*NH*L*L
    gemm('N', 'N', hs, L, L, 1, qkv, q + C, 3*C, hs, ds, d, L, L*L, 1, dqkv, b*L*3*C, 3*C, hs, NH)
    gemm('N', 'T', hs, L, L, 1, qkv, q, 3*C, hs, ds, d, L, L*L, 1, dqkv, b*L*3*C + C, 3*C, hs, NH)
# numerical gradient of sum(y * dy) wrt qkv
def forward(qkv_flat):
    Q = qkv_flat.reshape(B, L, 3, NH, hs); out = np.zeros((B, L, NH, hs))
    for b in range(B):
        for h in range(NH):
            q, k, v = Q[b, :, 0, h], Q[b, :, 1, h], Q[b, :, 2, h]
            s = q @ k.T * scale; s = np.where(np.tril(np.ones((L, L))) > 0, s, -np.inf)
            e = np.exp(s - s.max(1, keepdims=True)); out[b, :, h] = (e/e.sum(1, keepdims=True)) @ v
    return (out.ravel()*dy).sum()
num = np.zeros_like(qkv); h = 1e-6
for i in range(qkv.size):
    p = qkv.copy(); p[i] += h; m = qkv.copy(); m[i] -= h
    num[i] = (forward(p) - forward(m))/(2*h)
print("attention backward max err", np.abs(num - dqkv).max())
assert np.abs(num - dqkv).max() < 1e-6
print("attention backward ok")
