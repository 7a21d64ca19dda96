/* philox.h - the random keep decisions of attention dropout.
 *
 * Philox4x32-10 (Salmon, Moraes, Dror and Shaw, "Parallel random numbers:
 * as easy as 1, 2, 3", SC 2011) maps a 128-bit counter and a 64-bit key to
 * 128 random bits with no state: the backward pass regenerates exactly the
 * forward's mask from (seed, head, i, j), whatever the tiles or threads.
 *
 * Weight (head, i, j) is kept when word j % 4 of
 *   Philox4x32-10(counter = (i, j / 4, head low, head high), key = (seed low, seed high))
 * is at least floor(p 2^32), p the dropout probability: probability 1 - p
 * up to 2^-32. head is the flat C-order index of the broadcast leading axes.
 */
#ifndef ATTNX_PHILOX_H
#define ATTNX_PHILOX_H

#include <stddef.h>
#include <stdint.h>

/* one Philox round: two 32 x 32 -> 64-bit products, words shuffled and
 * mixed with the key */
static inline void attnx_philox_round(uint32_t c[4], uint32_t k0, uint32_t k1)
{
    uint64_t p0 = (uint64_t)0xD2511F53u * c[0], p1 = (uint64_t)0xCD9E8D57u * c[2];
    uint32_t c1 = c[1], c3 = c[3];
    c[0] = (uint32_t)(p1 >> 32) ^ c1 ^ k0;
    c[1] = (uint32_t)p1;
    c[2] = (uint32_t)(p0 >> 32) ^ c3 ^ k1;
    c[3] = (uint32_t)p0;
}

/* Philox4x32-10: c <- the 128 random bits of counter c under key (k0, k1);
 * the key is bumped by the Weyl constants between rounds */
static inline void attnx_philox4x32_10(uint32_t c[4], uint32_t k0, uint32_t k1)
{
    for (int round = 0; round < 10; round++) {
        if (round > 0) {
            k0 += 0x9E3779B9u;
            k1 += 0xBB67AE85u;
        }
        attnx_philox_round(c, k0, k1);
    }
}

/* the smallest random word that keeps a weight: floor(p 2^32), 0 <= p < 1 */
static inline uint32_t attnx_dropout_threshold(double p)
{
    double scaled = p * 4294967296.0;
    return scaled >= 4294967295.0 ? 4294967295u : (uint32_t)scaled;
}

/* keep[c] = 1 when weight (head, i, j0 + c) is kept, for c < cols */
static inline void attnx_dropout_row(uint64_t seed, uint64_t head, uint64_t i, uint64_t j0,
                                     ptrdiff_t cols, uint32_t threshold, unsigned char *keep)
{
    uint32_t k0 = (uint32_t)seed, k1 = (uint32_t)(seed >> 32);
    ptrdiff_t c = 0;
    while (c < cols) {
        uint64_t j = j0 + (uint64_t)c;
        uint32_t words[4] = {(uint32_t)i, (uint32_t)(j / 4), (uint32_t)head,
                             (uint32_t)(head >> 32)};
        attnx_philox4x32_10(words, k0, k1);
        for (unsigned w = (unsigned)(j % 4); w < 4 && c < cols; w++, c++)
            keep[c] = words[w] >= threshold;
    }
}

#endif
