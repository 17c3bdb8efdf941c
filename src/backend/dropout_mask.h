/*
 * dropout_mask.h — LoRA dropout's mask as a pure function of integers, so
 * it is never stored: the forward draws it, the backward draws it again,
 * and the CPU backend, the CUDA kernels and the engine (which makes the
 * key) compute the same bits. Plain C, usable from .c and .cu files.
 *
 * A counter-based generator (splitmix64's finaliser, Stafford's mix 13):
 *   mix(z)  = splitmix64 output for state z (add 0x9e37..., three xor-shift-multiplies)
 *   key     = mix(mix(mix(seed) ^ counter) ^ tensor)            (per adapted projection, per forward)
 *   h(r, c) = mix(key ^ mix((r << 32) | c))                      (row r, column c of x [T, in])
 *   keep(r, c) = (h >> 32) >= threshold,  threshold = round(P 2^32)
 * so an element is kept with probability 1 - P (to 2^-32), and r is the
 * ORIGINAL row of the forward: a backward on compacted rows looks its rows
 * up in the kept-row index and regenerates the forward's mask.
 */
#ifndef CF_DROPOUT_MASK_H
#define CF_DROPOUT_MASK_H

#include <stdint.h>

#ifdef __CUDACC__
#define CF_DROPOUT_FN static __host__ __device__ __forceinline__
#else
#define CF_DROPOUT_FN static inline
#endif

CF_DROPOUT_FN uint64_t cf_dropout_mix(uint64_t z) {
    z += 0x9e3779b97f4a7c15ULL;
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    return z ^ (z >> 31);
}

/* The key of one adapted projection (tensor: its lora_A index) in the
 * forward numbered counter. */
CF_DROPOUT_FN uint64_t cf_dropout_key(uint64_t seed, uint64_t counter, uint64_t tensor) {
    return cf_dropout_mix(cf_dropout_mix(cf_dropout_mix(seed) ^ counter) ^ tensor);
}

/* 1 if element (row, col) is kept. */
CF_DROPOUT_FN int cf_dropout_keep(uint64_t key, uint32_t threshold, uint32_t row, uint32_t col) {
    uint64_t h = cf_dropout_mix(key ^ cf_dropout_mix(((uint64_t)row << 32) | col));
    return (uint32_t)(h >> 32) >= threshold;
}

/* threshold = round(P 2^32) for 0 <= P < 1 (an element is dropped when the
 * top 32 bits of its hash are below it). */
CF_DROPOUT_FN uint32_t cf_dropout_threshold(double p) {
    double t = p * 4294967296.0 + 0.5;
    return t <= 0 ? 0u : t >= 4294967295.0 ? 0xffffffffu : (uint32_t)t;
}

#endif /* CF_DROPOUT_MASK_H */
