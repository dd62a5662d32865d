/* Decode attention read straight through block tables: one new query token per sequence.
 *
 *     out [B, H, D] = softmax(scale * q . K^T) V,  for each sequence b and query head h,
 *
 * over the keys and values of positions [start_b, length_b) of sequence b, where position p lives in
 * slot tables[b, p / block_size] * block_size + p % block_size of one layer's pool
 * keys, values [num_blocks * block_size, H_kv, D], and start_b = max(0, length_b - window) with a
 * sliding window (window > 0), else 0. Query head h reads KV head h / (H / H_kv) (grouped-query
 * attention: nothing is copied per query head).
 *
 * The engine's torch path gathers every block of a decode group into a new tensor and runs SDPA with
 * a padding mask: some fifteen small operations per layer. Here each (b, h) is one task: its scores
 * into a scratch row, their maximum, exp and sum, then the values weighted by them. The result equals
 * SDPA's to float32 rounding (the sums run in another order). The threads split the B * H tasks.
 *
 * The `_tasks` functions run some of the tasks on the calling thread, inside a parallel region of the
 * caller's: `q4_1_decode_layers` in gguf_gemv.c, whose whole decode step is one region, over the paged
 * store or over one layer of a contiguous KVCache [B, H_kv, S_max, D] (`cached_decode_attention_tasks`).
 *
 * Plain C with AVX2/FMA intrinsics and OpenMP; no torch headers (called through ctypes).
 */
#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>

/* a . b over n floats: 8 lanes at a time, then the rest one by one. */
static inline float dot(const float *a, const float *b, int64_t n) {
    __m256 sum = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) sum = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), sum);
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(sum), _mm256_extractf128_ps(sum, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    float total = _mm_cvtss_f32(s);
    for (; i < n; i++) total += a[i] * b[i];
    return total;
}

/* acc[0..n) += w * v[0..n). */
static inline void add_scaled(float *acc, const float *v, float w, int64_t n) {
    const __m256 weight = _mm256_set1_ps(w);
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(acc + i, _mm256_fmadd_ps(weight, _mm256_loadu_ps(v + i), _mm256_loadu_ps(acc + i)));
    for (; i < n; i++) acc[i] += w * v[i];
}

/* One task: a query [D] over the keys and values of positions [start, length), position p at
 * keys + slot(p) * row_stride (values alike), slot(p) = table[p / block_size] * block_size + p % block_size,
 * or p itself without a table. Softmax(scale * q . k) into `scores` (scratch), then the values
 * weighted by it into o [D]. */
static void attend_one(const float *query, const float *keys, const float *values, const int64_t *table,
                       int64_t block_size, int64_t row_stride, int64_t start, int64_t length, int64_t D, float scale,
                       float *scores, float *o) {
    float top = -INFINITY;
    for (int64_t p = start; p < length; p++) {
        const int64_t slot = table ? table[p / block_size] * block_size + p % block_size : p;
        const float s = dot(query, keys + slot * row_stride, D) * scale;
        scores[p - start] = s;
        if (s > top) top = s;
    }
    float total = 0.0f;
    for (int64_t p = start; p < length; p++) {
        const float e = expf(scores[p - start] - top);
        scores[p - start] = e;
        total += e;
    }
    for (int64_t i = 0; i < D; i++) o[i] = 0.0f;
    for (int64_t p = start; p < length; p++) {
        const int64_t slot = table ? table[p / block_size] * block_size + p % block_size : p;
        add_scaled(o, values + slot * row_stride, scores[p - start], D);
    }
    const float inverse = 1.0f / total;
    for (int64_t i = 0; i < D; i++) o[i] *= inverse;
}

/* The first of `length` keys a query attends to: the last `window` only (window > 0), else all. */
static inline int64_t first_key(int64_t length, int64_t window) {
    return window > 0 && length > window ? length - window : 0;
}

/* Tasks [first, end) of `paged_decode_attention` (task = b * H + h) on the calling thread, its scores
 * in `scores` [max_blocks * block_size]. */
void paged_decode_attention_tasks(const float *q, const float *keys, const float *values, const int64_t *tables,
                                  const int64_t *lengths, float *out, int64_t H, int64_t H_kv, int64_t D,
                                  int64_t block_size, int64_t max_blocks, int64_t window, float scale, float *scores,
                                  int64_t first, int64_t end) {
    const int64_t group = H / H_kv, row_stride = H_kv * D;
    for (int64_t task = first; task < end; task++) {
        const int64_t b = task / H, h = task % H, kv_head = h / group, length = lengths[b];
        attend_one(q + task * D, keys + kv_head * D, values + kv_head * D, tables + b * max_blocks, block_size,
                   row_stride, first_key(length, window), length, D, scale, scores, out + task * D);
    }
}

/* scratch: [threads, max_blocks * block_size] floats, one row of scores per thread. */
void paged_decode_attention(const float *q, const float *keys, const float *values, const int64_t *tables,
                            const int64_t *lengths, float *out, int64_t B, int64_t H, int64_t H_kv, int64_t D,
                            int64_t block_size, int64_t max_blocks, int64_t window, float scale, float *scratch,
                            int threads) {
#pragma omp parallel num_threads(threads)
    {
        const int t = omp_get_thread_num(), team = omp_get_num_threads();
        paged_decode_attention_tasks(q, keys, values, tables, lengths, out, H, H_kv, D, block_size, max_blocks, window,
                                     scale, scratch + (int64_t)t * max_blocks * block_size, B * H * t / team,
                                     B * H * (t + 1) / team);
    }
}

/* Tasks [first, end) of the same over one layer of a contiguous cache (`decodelab.model.kv_cache.KVCache`):
 * keys, values [B, H_kv, S_max, D], every sequence holding `length` keys (the new one included); q, out
 * [B, H, D]. On the calling thread, its scores in `scores` [S_max]. */
void cached_decode_attention_tasks(const float *q, const float *keys, const float *values, float *out, int64_t H,
                                   int64_t H_kv, int64_t D, int64_t S_max, int64_t length, int64_t window, float scale,
                                   float *scores, int64_t first, int64_t end) {
    const int64_t group = H / H_kv, start = first_key(length, window);
    for (int64_t task = first; task < end; task++) {
        const int64_t b = task / H, kv_head = (task % H) / group, at = (b * H_kv + kv_head) * S_max * D;
        attend_one(q + task * D, keys + at, values + at, 0, 1, D, start, length, D, scale, scores, out + task * D);
    }
}
