// Decode-loop bookkeeping on the device, so a replayed CUDA graph needs no host write per step.
//
// advance_positions: after a decode step has appended each row's input token at positions[i]
// and sampled the next token, row i moves one position on: positions[i] += 1 and
// lengths[i] = positions[i] + 1 (both updated in place, =). Rows >= b are left alone.
#include "common.cuh"

// kernels

extern "C" __global__ void advance_positions(int* positions, int* lengths, int b) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < b) {
        const int p = positions[i] + 1;
        positions[i] = p;
        lengths[i] = p + 1;
    }
}
