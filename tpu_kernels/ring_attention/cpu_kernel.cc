// `ring_attention` for XLA:CPU: a fused kernel called through XLA's FFI (cpu.py builds and registers it).
//
// One task per (session, KV head), spread over XLA's intra-op thread pool. A task folds its session's new
// queries of that head's group into rows (position-major, `rows_per_block` at a time), then streams the
// keys those rows can see in blocks of at most kKeys consecutive positions, straight from the pages (the
// old positions of the window) and then from the chunk itself, with an online softmax. Only positions
// inside some row's window are read: the cost follows the filled part of the window. Every score stays in
// a block-sized scratch, so nothing the size of [rows, window] is ever written to memory.
//
// The layout and position rules are design.md's (positions.py): position p of session s lives in page
// page_table[s, (p mod R) / page_size] at offset (p mod R) mod page_size, R = pages_per_window x page_size;
// the chunk's own keys are k_new[s, i] at position lengths[s] + i; row i sees (pos - window, pos].
// Rows i >= num_new[s] are padding: they output zeros (so does a session with num_new = 0). A page-table
// entry outside the pool reads the page XLA's gather would (PageOf): a bad table never reads out of bounds.
// A key or value at a position a row cannot see never reaches that row, not even as 0 x NaN.
#include <algorithm>
#include <atomic>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <mutex>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

using F32R4 = ffi::Buffer<ffi::F32, 4>;
using S32R1 = ffi::Buffer<ffi::S32, 1>;
using S32R2 = ffi::Buffer<ffi::S32, 2>;

// Keys per block: one 64-wide score row is four AVX-512 (eight AVX2) registers.
constexpr int64_t kKeys = 64;
// Query rows (positions x group) per block: a Voxtral encoder chunk of 64 frames is one block.
constexpr int64_t kRowsPerBlock = 64;
// Rows per block below which scores are dot products over the head dim: transposing a block of keys costs
// more than a few rows' products (a Voxtral decoder step has 4 rows, one query of 4 heads per KV head).
constexpr int64_t kMinRowsToTranspose = 8;
// Multiply-adds below which a call runs on the calling thread alone: a decoder step of a few sessions
// costs less than waking the pool.
constexpr double kMinParallelWork = 2e5;

// exp(x) for x <= 0 that the compiler vectorises (glibc's expf is a scalar call): Cody-Waite reduction to
// x = n ln2 + f, |f| <= ln2 / 2, Cephes' degree-6 polynomial for exp(f), 2^n built in the exponent bits.
// Within 2 ulp of expf; 0 below -87.3, where expf's result would be subnormal (slow) or 0.
inline float ExpNonPositive(float x) {
  const float clamped = std::max(x, -87.3f);
  const float n = std::floor(clamped * 1.44269504f + 0.5f);
  const float f = clamped - n * 0.693359375f + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * f + 1.3981999507e-3f;
  p = p * f + 8.3334519073e-3f;
  p = p * f + 4.1665795894e-2f;
  p = p * f + 1.6666665459e-1f;
  p = p * f + 5.0000001201e-1f;
  p = p * f * f + f + 1.f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return x < -87.3f ? 0.f : p * scale;
}

struct Problem {
  const float *q, *k_new, *v_new, *k_pages, *v_pages;
  const int32_t *page_table, *lengths, *num_new;
  float* out;
  int64_t sessions, chunk, q_heads, kv_heads, group, head_dim, page_size, pages_per_window, window, num_pages;
  float scale;
};

// The physical page a page-table entry reads, as XLA's gather (jnp indexing) reads it: a negative entry
// counts from the end of the pool, and the result is clamped into the pool. Entries are promised valid, but
// the table is traced data: one out of range must read some page of the pool, not memory past it.
inline int64_t PageOf(int64_t entry, int64_t num_pages) {
  if (entry < 0) entry += num_pages;
  return std::clamp<int64_t>(entry, 0, num_pages - 1);
}

// Per-thread buffers, reused across tasks and calls.
struct Scratch {
  std::vector<float> queries, acc, row_max, row_sum, keys_t, scores;
  std::vector<int64_t> first_key, end_key;

  void Reserve(int64_t rows, int64_t head_dim) {
    queries.resize(rows * head_dim);
    acc.resize(rows * head_dim);
    row_max.resize(rows);
    row_sum.resize(rows);
    keys_t.resize(head_dim * kKeys);
    scores.resize(rows * kKeys);
    first_key.resize(rows);
    end_key.resize(rows);
  }
};

// One (session, head) task; kHeadDim > 0 fixes the head dim at compile time (64 and 128: the loops over it
// unroll into whole registers), 0 reads it from the problem.
template <int64_t kHeadDim>
class Task {
 public:
  Task(const Problem& pr, Scratch& w, int64_t session, int64_t head)
      : pr_(pr), w_(w), s_(session), h_(head), length_(pr.lengths[session]),
        d_(pr.head_dim) {}

  void Run() {
    const int64_t num_new = std::min<int64_t>(std::max<int32_t>(pr_.num_new[s_], 0), pr_.chunk);
    for (int64_t i = num_new; i < pr_.chunk; ++i)
      for (int64_t g = 0; g < pr_.group; ++g) std::fill(OutRow(i, g), OutRow(i, g) + d_, 0.f);
    const int64_t positions_per_block = std::max<int64_t>(1, kRowsPerBlock / pr_.group);
    const int64_t ring = pr_.pages_per_window * pr_.page_size;
    for (int64_t first = 0; first < num_new; first += positions_per_block) {
      const int64_t last = std::min(num_new, first + positions_per_block);
      StartRows(first, last);
      // The old positions the first row can see, page run by page run, then the chunk's keys up to the
      // last row.
      for (int64_t p = std::max<int64_t>(0, length_ + first - pr_.window + 1); p < length_;) {
        const int64_t ring_index = p % ring;
        const int64_t page = PageOf(pr_.page_table[s_ * pr_.pages_per_window + ring_index / pr_.page_size],
                                    pr_.num_pages);
        const int64_t offset = ring_index % pr_.page_size;
        const int64_t count = std::min({pr_.page_size - offset, length_ - p, kKeys});
        const int64_t base = ((page * pr_.kv_heads + h_) * pr_.page_size + offset) * d_;
        KeyBlock(pr_.k_pages + base, pr_.v_pages + base, d_, count, p);
        p += count;
      }
      for (int64_t t = 0; t < last; t += kKeys) {
        const int64_t base = ((s_ * pr_.chunk + t) * pr_.kv_heads + h_) * d_;
        KeyBlock(pr_.k_new + base, pr_.v_new + base, pr_.kv_heads * d_, std::min(kKeys, last - t), length_ + t);
      }
      FinishRows();
    }
  }

 private:
  float* OutRow(int64_t i, int64_t g) const {
    return pr_.out + ((s_ * pr_.chunk + i) * pr_.q_heads + h_ * pr_.group + g) * d_;
  }

  void StartRows(int64_t first, int64_t last) {
    first_ = first;
    rows_ = (last - first) * pr_.group;
    for (int64_t r = 0; r < rows_; ++r) {
      const float* q = pr_.q + ((s_ * pr_.chunk + first + r / pr_.group) * pr_.q_heads + h_ * pr_.group +
                                r % pr_.group) * d_;
      for (int64_t e = 0; e < d_; ++e) w_.queries[r * d_ + e] = q[e] * pr_.scale;
    }
    std::fill(w_.acc.begin(), w_.acc.begin() + rows_ * d_, 0.f);
    std::fill(w_.row_max.begin(), w_.row_max.begin() + rows_, -std::numeric_limits<float>::infinity());
    std::fill(w_.row_sum.begin(), w_.row_sum.begin() + rows_, 0.f);
  }

  void FinishRows() {
    for (int64_t r = 0; r < rows_; ++r) {
      float* out = OutRow(first_ + r / pr_.group, r % pr_.group);
      const float inv = w_.row_sum[r] > 0.f ? 1.f / w_.row_sum[r] : 0.f;
      for (int64_t e = 0; e < d_; ++e) out[e] = w_.acc[r * d_ + e] * inv;
    }
  }

  // count <= kKeys keys at consecutive positions from key_pos; key/value rows `stride` floats apart.
  void KeyBlock(const float* keys, const float* values, int64_t stride, int64_t count, int64_t key_pos) {
    int64_t lo = kKeys, hi = 0;  // The union of the rows' visible key ranges.
    for (int64_t r = 0; r < rows_; ++r) {
      const int64_t pos = length_ + first_ + r / pr_.group;
      w_.first_key[r] = std::max<int64_t>(0, pos - pr_.window + 1 - key_pos);
      w_.end_key[r] = std::min<int64_t>(count, pos - key_pos + 1);
      if (w_.end_key[r] > w_.first_key[r]) {
        lo = std::min(lo, w_.first_key[r]);
        hi = std::max(hi, w_.end_key[r]);
      }
    }
    if (hi <= lo) return;
    if (rows_ < kMinRowsToTranspose) {
      RowScores(keys, stride, lo, hi);
    } else {
      TransposeKeys(keys, stride, count);
      Scores();
    }
    Softmax();
    AccumulateValues(values, stride);
  }

  // Keys transposed to [D, kKeys] (zero past `count`), so a score row is a sum of D scaled key rows.
  void TransposeKeys(const float* keys, int64_t stride, int64_t count) {
    const int64_t D = HeadDim();
    float* __restrict__ keys_t = w_.keys_t.data();
    for (int64_t k = 0; k < count; ++k)
      for (int64_t e = 0; e < D; ++e) keys_t[e * kKeys + k] = keys[k * stride + e];
    for (int64_t e = 0; e < D; ++e) std::fill(keys_t + e * kKeys + count, keys_t + (e + 1) * kKeys, 0.f);
  }

  // Scores of keys lo..hi-1 as one dot product per (row, key); the rest of each score row is left as is
  // (the softmax reads only each row's visible range).
  void RowScores(const float* keys, int64_t stride, int64_t lo, int64_t hi) {
    const int64_t D = HeadDim();
    const float* queries = w_.queries.data();
    for (int64_t k = lo; k < hi; ++k) {
      const float* __restrict__ key = keys + k * stride;
      for (int64_t r = 0; r < rows_; ++r) {
        const float* __restrict__ query = queries + r * D;
        float dot = 0.f;
        for (int64_t e = 0; e < D; ++e) dot += query[e] * key[e];
        w_.scores[r * kKeys + k] = dot;
      }
    }
  }

  // The head dim, a compile-time constant where the template fixes it. Scalars read in the inner loops
  // are hoisted into locals below: the compiler cannot tell that the float arrays written there do not
  // alias them, and reloading each one per element halved the kernel's speed.
  int64_t HeadDim() const { return kHeadDim > 0 ? kHeadDim : d_; }

  void Scores() {
    const int64_t D = HeadDim();
    const float* keys_t = w_.keys_t.data();
    const float* queries = w_.queries.data();
    float* scores = w_.scores.data();
    int64_t r = 0;
    for (; r + 4 <= rows_; r += 4) {  // Four rows share each load of the keys.
      float a0[kKeys] = {}, a1[kKeys] = {}, a2[kKeys] = {}, a3[kKeys] = {};
      const float *q0 = queries + r * D, *q1 = q0 + D, *q2 = q1 + D, *q3 = q2 + D;
      for (int64_t e = 0; e < D; ++e) {
        const float* key = keys_t + e * kKeys;
        const float b0 = q0[e], b1 = q1[e], b2 = q2[e], b3 = q3[e];
        for (int64_t k = 0; k < kKeys; ++k) {
          a0[k] += b0 * key[k];
          a1[k] += b1 * key[k];
          a2[k] += b2 * key[k];
          a3[k] += b3 * key[k];
        }
      }
      std::memcpy(scores + r * kKeys, a0, sizeof a0);
      std::memcpy(scores + (r + 1) * kKeys, a1, sizeof a1);
      std::memcpy(scores + (r + 2) * kKeys, a2, sizeof a2);
      std::memcpy(scores + (r + 3) * kKeys, a3, sizeof a3);
    }
    for (; r < rows_; ++r) {
      float a0[kKeys] = {};
      const float* q0 = queries + r * D;
      for (int64_t e = 0; e < D; ++e) {
        const float b0 = q0[e];
        for (int64_t k = 0; k < kKeys; ++k) a0[k] += b0 * keys_t[e * kKeys + k];
      }
      std::memcpy(scores + r * kKeys, a0, sizeof a0);
    }
  }

  // Scores become this block's probabilities (0 outside each row's range) under the running maximum; the
  // rows' running sums and accumulators are rescaled to it.
  void Softmax() {
    for (int64_t r = 0; r < rows_; ++r) {
      float* row = w_.scores.data() + r * kKeys;
      const int64_t a = w_.first_key[r], b = w_.end_key[r];
      if (b <= a) {
        std::fill(row, row + kKeys, 0.f);
        continue;
      }
      float block_max = -std::numeric_limits<float>::infinity();
      for (int64_t k = a; k < b; ++k) block_max = std::max(block_max, row[k]);
      const float new_max = std::max(w_.row_max[r], block_max);
      const float rescale = ExpNonPositive(w_.row_max[r] - new_max);  // 0 for the first block a row sees.
      float sum = 0.f;
      std::fill(row, row + a, 0.f);
      for (int64_t k = a; k < b; ++k) {
        const float p = ExpNonPositive(row[k] - new_max);
        row[k] = p;
        sum += p;
      }
      std::fill(row + b, row + kKeys, 0.f);
      w_.row_sum[r] = w_.row_sum[r] * rescale + sum;
      w_.row_max[r] = new_max;
      if (rescale != 1.f) {
        float* acc = w_.acc.data() + r * HeadDim();
        for (int64_t e = 0; e < HeadDim(); ++e) acc[e] *= rescale;
      }
    }
  }

  // Keys lo..hi-1: those every row of r..r+count-1 sees, the intersection of their ranges (lo = hi = 0 when
  // it is empty).
  void CommonSpan(int64_t r, int64_t count, int64_t& lo, int64_t& hi) const {
    lo = 0;
    hi = kKeys;
    for (int64_t i = r; i < r + count; ++i) {
      lo = std::max(lo, w_.first_key[i]);
      hi = std::min(hi, w_.end_key[i]);
    }
    if (hi <= lo) lo = hi = 0;
  }

  // Each row adds the values of its own visible keys only: a key outside a row's window has probability 0
  // there, but 0 x NaN is NaN, and a non-finite value that some rows of a block see (an old position that
  // slid out of a later row's window, a chunk key after an earlier row) must not reach the rest. Keys that
  // four rows all see share each load of a value; the few at the edges of their windows (a row or two per
  // block and side) are added row by row. A narrow window (the tiny model's 12 encoder frames) reads a few of
  // a block's 64 values, not all of them.
  void AccumulateValues(const float* values, int64_t stride) {
    const int64_t D = HeadDim();
    const float* probs = w_.scores.data();
    float* acc = w_.acc.data();
    int64_t r = 0, lo, hi;
    for (; r + 4 <= rows_; r += 4) {
      CommonSpan(r, 4, lo, hi);
      float* __restrict__ c0 = acc + r * D;
      float* __restrict__ c1 = c0 + D;
      float* __restrict__ c2 = c1 + D;
      float* __restrict__ c3 = c2 + D;
      const float *p0 = probs + r * kKeys, *p1 = p0 + kKeys, *p2 = p1 + kKeys, *p3 = p2 + kKeys;
      for (int64_t k = lo; k < hi; ++k) {
        const float* __restrict__ value = values + k * stride;
        const float b0 = p0[k], b1 = p1[k], b2 = p2[k], b3 = p3[k];
        for (int64_t e = 0; e < D; ++e) {
          c0[e] += b0 * value[e];
          c1[e] += b1 * value[e];
          c2[e] += b2 * value[e];
          c3[e] += b3 * value[e];
        }
      }
      for (int64_t i = r; i < r + 4; ++i) {  // Each row's keys outside [lo, hi): its range contains it.
        const int64_t a = w_.first_key[i], b = w_.end_key[i];
        if (b <= a) continue;
        AccumulateRow(values, stride, i, a, std::min(b, lo));
        AccumulateRow(values, stride, i, std::max(a, hi), b);
      }
    }
    for (; r < rows_; ++r) AccumulateRow(values, stride, r, w_.first_key[r], w_.end_key[r]);
  }

  // Row r adds the values of keys a..b-1.
  void AccumulateRow(const float* values, int64_t stride, int64_t r, int64_t a, int64_t b) {
    const int64_t D = HeadDim();
    float* __restrict__ c0 = w_.acc.data() + r * D;
    const float* p0 = w_.scores.data() + r * kKeys;
    for (int64_t k = a; k < b; ++k) {
      const float* __restrict__ value = values + k * stride;
      const float b0 = p0[k];
      for (int64_t e = 0; e < D; ++e) c0[e] += b0 * value[e];
    }
  }

  const Problem& pr_;
  Scratch& w_;
  const int64_t s_, h_, length_, d_;
  int64_t first_ = 0, rows_ = 0;
};

void RunTask(const Problem& pr, int64_t task, Scratch& w) {
  const int64_t s = task / pr.kv_heads, h = task % pr.kv_heads;
  switch (pr.head_dim) {
    case 64: Task<64>(pr, w, s, h).Run(); break;
    case 128: Task<128>(pr, w, s, h).Run(); break;
    default: Task<0>(pr, w, s, h).Run();
  }
}

// Tasks are claimed from a shared counter by the calling thread and by helpers scheduled on the pool. The
// caller waits for the tasks to be done, never for a helper to start: a pool busy elsewhere (or with every
// thread inside XLA calls like this one) only means the caller does the work alone.
struct Batch {
  Problem pr;
  int64_t tasks = 0;
  std::atomic<int64_t> next{0}, done{0};
  std::mutex mu;
  std::condition_variable all_done;
};

void Work(const std::shared_ptr<Batch>& batch) {
  thread_local Scratch w;
  w.Reserve(std::max(kRowsPerBlock, batch->pr.group), batch->pr.head_dim);
  for (int64_t task; (task = batch->next.fetch_add(1)) < batch->tasks;) {
    RunTask(batch->pr, task, w);
    if (batch->done.fetch_add(1) + 1 == batch->tasks) {
      std::lock_guard<std::mutex> lock(batch->mu);
      batch->all_done.notify_all();
    }
  }
}

ffi::Error RingAttention(ffi::ThreadPool pool, F32R4 q, F32R4 k_new, F32R4 v_new, F32R4 k_pages, F32R4 v_pages,
                         S32R2 page_table, S32R1 lengths, S32R1 num_new, int64_t window, float scale,
                         ffi::ResultBuffer<ffi::F32, 4> out) {
  const auto qd = q.dimensions(), pd = k_pages.dimensions();
  auto batch = std::make_shared<Batch>();
  batch->pr = Problem{q.typed_data(), k_new.typed_data(), v_new.typed_data(), k_pages.typed_data(),
                      v_pages.typed_data(), page_table.typed_data(), lengths.typed_data(), num_new.typed_data(),
                      out->typed_data(), qd[0], qd[1], qd[2], pd[1], qd[2] / pd[1], qd[3], pd[2],
                      page_table.dimensions()[1], window, pd[0], scale};
  const Problem& pr = batch->pr;
  batch->tasks = pr.sessions * pr.kv_heads;
  double work = 0;
  for (int64_t s = 0; s < pr.sessions; ++s) {
    const double rows = std::min<int64_t>(std::max<int32_t>(pr.num_new[s], 0), pr.chunk);
    work += rows * pr.q_heads * (std::min<int64_t>(std::max<int32_t>(pr.lengths[s], 0), window) + rows) *
            pr.head_dim * 2;
  }
  const int64_t helpers =
      work < kMinParallelWork ? 0 : std::min<int64_t>(pool.num_threads(), batch->tasks - 1);
  for (int64_t i = 0; i < helpers; ++i) pool.Schedule([batch] { Work(batch); });
  Work(batch);
  std::unique_lock<std::mutex> lock(batch->mu);
  batch->all_done.wait(lock, [&] { return batch->done.load() == batch->tasks; });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxstreamRingAttention, RingAttention,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<F32R4>()  // q [S, C, Hq, D]
                                  .Arg<F32R4>()  // k_new [S, C, Hkv, D]
                                  .Arg<F32R4>()  // v_new
                                  .Arg<F32R4>()  // k_pages [num_pages, Hkv, page_size, D]
                                  .Arg<F32R4>()  // v_pages
                                  .Arg<S32R2>()  // page_table [S, pages_per_window]
                                  .Arg<S32R1>()  // lengths [S]
                                  .Arg<S32R1>()  // num_new [S]
                                  .Attr<int64_t>("window")
                                  .Attr<float>("scale")
                                  .Ret<F32R4>());  // out [S, C, Hq, D]
