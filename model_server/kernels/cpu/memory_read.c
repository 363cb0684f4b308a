/* The host's read bandwidth, for `bench latency`'s read bound (benchmarks/bandwidth.py): a
 * decode step at batch 1 reads its weights and writes almost nothing, so the bound it can reach
 * is the memory's read rate, not a copy's read + write rate.
 *
 * wick_memory_read reads buf [nbytes] once: each of `num_threads` threads takes a contiguous
 * share of the 64-byte lines and splits it into `streams` equal sub-ranges that it reads
 * interleaved, one line of each per round, so that several independent streams are in flight per
 * core (as a GEMV over several weight rows or panels has), which is what lets the core's
 * outstanding misses and the hardware prefetchers reach the memory's rate; one stream per core
 * stays latency bound. The loaded values are summed into 64-bit lanes so that no load is dead;
 * the sum goes to *checksum (callers may ignore it). Lines left over by the split (fewer than
 * threads x streams) are not read: nbytes must be far larger than that for a bandwidth figure.
 * Returns 0; -1 when streams is outside [1, WICK_READ_MAX_STREAMS] or nbytes holds fewer than
 * one line per stream and thread (nothing read). */
#include <stdint.h>
#include <string.h>

#include "wick_cpu.h"
#include "wick_entry.h"
#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#define LINE 64 /* bytes: one cache line */

#if defined(__AVX512F__)
typedef __m512i lane_t;
static inline lane_t lane_zero(void) { return _mm512_setzero_si512(); }
static inline lane_t lane_add_line(const lane_t acc, const uint8_t *p) {
  return _mm512_add_epi64(acc, _mm512_loadu_si512((const void *)p));
}
static inline uint64_t lane_sum(const lane_t acc) {
  return (uint64_t)_mm512_reduce_add_epi64(acc);
}
#elif defined(__AVX2__)
typedef __m256i lane_t;
static inline lane_t lane_zero(void) { return _mm256_setzero_si256(); }
static inline lane_t lane_add_line(const lane_t acc, const uint8_t *p) {
  const __m256i a = _mm256_loadu_si256((const __m256i *)p);
  const __m256i b = _mm256_loadu_si256((const __m256i *)(p + 32));
  return _mm256_add_epi64(acc, _mm256_add_epi64(a, b));
}
static inline uint64_t lane_sum(const lane_t acc) {
  uint64_t v[4];
  memcpy(v, &acc, sizeof v);
  return v[0] + v[1] + v[2] + v[3];
}
#else
typedef uint64_t lane_t;
static inline lane_t lane_zero(void) { return 0; }
static inline lane_t lane_add_line(lane_t acc, const uint8_t *p) {
  uint64_t v[LINE / 8];
  memcpy(v, p, sizeof v);
  for (int i = 0; i < LINE / 8; i++) acc += v[i];
  return acc;
}
static inline uint64_t lane_sum(const lane_t acc) { return acc; }
#endif

/* Lines [0, lines) of each of s streams `stride` bytes apart from p, interleaved; s is a
 * compile-time constant after inlining, so the accumulators stay in registers. */
static inline __attribute__((always_inline)) uint64_t read_streams(const int s,
                                                                   const uint8_t *p,
                                                                   const int64_t stride,
                                                                   const int64_t lines) {
  lane_t acc[WICK_READ_MAX_STREAMS];
  for (int j = 0; j < s; j++) acc[j] = lane_zero();
  for (int64_t i = 0; i < lines; i++)
    for (int j = 0; j < s; j++) acc[j] = lane_add_line(acc[j], p + j * stride + i * LINE);
  uint64_t sum = 0;
  for (int j = 0; j < s; j++) sum += lane_sum(acc[j]);
  return sum;
}

static uint64_t read_share(const int streams, const uint8_t *p, const int64_t stride,
                           const int64_t lines) {
  switch (streams) {
  case 1: return read_streams(1, p, stride, lines);
  case 2: return read_streams(2, p, stride, lines);
  case 3: return read_streams(3, p, stride, lines);
  case 4: return read_streams(4, p, stride, lines);
  case 5: return read_streams(5, p, stride, lines);
  case 6: return read_streams(6, p, stride, lines);
  case 7: return read_streams(7, p, stride, lines);
  default: return read_streams(WICK_READ_MAX_STREAMS, p, stride, lines);
  }
}

int wick_memory_read(const void *buf, int64_t nbytes, int streams, int num_threads,
                     uint64_t *checksum) {
  const int threads = num_threads > 1 ? num_threads : 1;
  if (streams < 1 || streams > WICK_READ_MAX_STREAMS) return -1;
  /* Lines per stream: every thread's share is the same whole number of lines per stream. */
  const int64_t lines = nbytes / LINE / threads / streams;
  if (lines < 1) return -1;
  const uint8_t *base = (const uint8_t *)buf;
  const int64_t stride = lines * LINE, share = stride * streams;
  uint64_t total = 0;
#pragma omp parallel for num_threads(threads) if (threads > 1) schedule(static) \
    reduction(+ : total)
  for (int t = 0; t < threads; t++) total += read_share(streams, base + t * share, stride, lines);
  if (checksum != NULL) *checksum = total;
  return 0;
}
