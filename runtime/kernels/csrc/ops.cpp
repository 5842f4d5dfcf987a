// The torch operators over the C core (tandem_cpu.h): one schema for each, in TORCH_LIBRARY below, and a
// wrapper that reads shapes, strides and dtypes from the tensors and checks every one of them before a
// pointer reaches C. A failed check is a RuntimeError that names the operator and the argument; nothing
// here is an assert, so `python -O` keeps every check. The kernels trust what passes.
//
// Every operator writes into tensors its caller allocated (marked `(a!)` in its schema) and returns
// nothing: the launchers in cpu_native.py allocate, and a captured decode step (decode_graph.py) replays
// a mutating op on the same tensors without a copy.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <climits>
#include <initializer_list>
#include <optional>
#include <string>

#include "tandem_cpu.h"

namespace {

using at::Tensor;
using c10::ScalarType;
using OptionalTensor = std::optional<Tensor>;

constexpr std::initializer_list<ScalarType> kNative = {ScalarType::Float, ScalarType::BFloat16};

std::string dtype_names(std::initializer_list<ScalarType> dtypes) {
  std::string names;
  for (ScalarType dtype : dtypes) names += (names.empty() ? "" : " or ") + std::string(c10::toString(dtype));
  return names;
}

// A check whose message is built only when it fails: a launch pays for the comparisons alone (building the
// messages up front cost 10-30 us a launch, more than the kernels of a batch-1 decode step).
#define TANDEM_REQUIRE(args, ok, name, what) \
  do {                                       \
    if (!(ok)) (args).fail(name, what);      \
  } while (false)

// The checks of one operator's arguments; each failure names the operator and the argument.
class Args {
 public:
  explicit Args(const char *op) : op_(op) {}

  void fail(const char *name, const std::string &what) const {
    TORCH_CHECK(false, "tandem::", op_, ": argument '", name, "' ", what);
  }

  // A CPU tensor of `dims` dimensions and one of `dtypes`.
  void tensor(const char *name, const Tensor &t, std::initializer_list<ScalarType> dtypes, int64_t dims) const {
    TANDEM_REQUIRE(*this, t.defined(), name, "is undefined");
    TANDEM_REQUIRE(*this, t.device().is_cpu(), name, "must be on the CPU, got " + t.device().str());
    bool known = false;
    for (ScalarType dtype : dtypes) known |= t.scalar_type() == dtype;
    TANDEM_REQUIRE(*this, known, name, "must be " + dtype_names(dtypes) + ", got " + c10::toString(t.scalar_type()));
    TANDEM_REQUIRE(*this, t.dim() == dims, name,
                   "must have " + std::to_string(dims) + " dimensions, got shape " + c10::str(t.sizes()));
  }

  void same_dtype(const char *name, const Tensor &t, const Tensor &like, const char *like_name) const {
    TANDEM_REQUIRE(*this, t.scalar_type() == like.scalar_type(), name,
                   std::string("must have the dtype of '") + like_name + "' (" + c10::toString(like.scalar_type()) +
                       "), got " + c10::toString(t.scalar_type()));
  }

  void shape(const char *name, const Tensor &t, c10::IntArrayRef expected) const {
    TANDEM_REQUIRE(*this, t.sizes() == expected, name,
                   "must have shape " + c10::str(expected) + ", got " + c10::str(t.sizes()));
  }

  // The dimensions from `first` on are laid out contiguously (the kernels compute offsets within them);
  // the dimensions before it may have any stride.
  void contiguous_from(const char *name, const Tensor &t, int64_t first) const {
    int64_t expected = 1;
    for (int64_t d = t.dim() - 1; d >= first; d--) {
      TANDEM_REQUIRE(*this, t.size(d) == 1 || t.stride(d) == expected, name,
                     "must be contiguous in its last " + std::to_string(t.dim() - first) +
                         " dimension(s), got strides " + c10::str(t.strides()) + " for shape " + c10::str(t.sizes()));
      expected *= t.size(d);
    }
  }

  void contiguous(const char *name, const Tensor &t) const { contiguous_from(name, t, 0); }

  void optional(const char *name, const OptionalTensor &t, ScalarType dtype, c10::IntArrayRef expected) const {
    if (!t.has_value()) return;
    tensor(name, *t, {dtype}, static_cast<int64_t>(expected.size()));
    shape(name, *t, expected);
    contiguous(name, *t);
  }

  // A count the C core takes as an int.
  int count(const char *name, int64_t value) const {
    TANDEM_REQUIRE(*this, value >= 0 && value <= INT_MAX, name, "has a size out of range: " + std::to_string(value));
    return static_cast<int>(value);
  }

  // Slots of a pool of `limit` entries: each in [-1, limit), -1 meaning "no slot" (a padded row).
  void slots(const char *name, const Tensor &slots, int64_t limit) const {
    const int64_t *values = slots.data_ptr<int64_t>();
    for (int64_t i = 0; i < slots.numel(); i++)
      TANDEM_REQUIRE(*this, values[i] >= -1 && values[i] < limit, name,
                     "holds " + std::to_string(values[i]) + " at " + std::to_string(i) + ", outside [-1, " +
                         std::to_string(limit) + ")");
  }

  // A decode kernel's pages: (rows,) without waves; with a verify's waves (runtime/waves.py), the page chains
  // (waves + 1, sequences), sequences = waves[0], the waves positive, not growing and covering the rows.
  // Returns the sequences.
  int64_t chains(const Tensor &pages, const at::OptionalIntArrayRef &waves, int64_t rows, int64_t limit) const {
    tensor("slots", pages, {ScalarType::Long}, waves.has_value() ? 2 : 1);
    contiguous("slots", pages);
    if (!waves.has_value()) {
      shape("slots", pages, {rows});
      slots("slots", pages, limit);
      return rows;
    }
    const c10::IntArrayRef w = *waves;
    TANDEM_REQUIRE(*this, !w.empty(), "waves", "must hold at least one wave");
    int64_t total = 0;
    for (size_t i = 0; i < w.size(); i++) {
      TANDEM_REQUIRE(*this, w[i] > 0 && (i == 0 || w[i] <= w[i - 1]), "waves",
                     "must be positive and must not grow, got " + c10::str(w));
      total += w[i];
    }
    TANDEM_REQUIRE(*this, total == rows, "waves",
                   "must add up to the rows of 'x', " + std::to_string(rows) + ", got " + c10::str(w));
    shape("slots", pages, {static_cast<int64_t>(w.size()) + 1, w[0]});
    slots("slots", pages, limit);
    return w[0];
  }

  // Token offsets of a batch of sequences: 0, non-decreasing, ending at `tokens`.
  void starts(const char *name, const Tensor &starts, int64_t tokens) const {
    const int32_t *values = starts.data_ptr<int32_t>();
    const int64_t n = starts.numel();
    TANDEM_REQUIRE(*this, values[0] == 0 && values[n - 1] == tokens, name,
                   "must run from 0 to the number of tokens, " + std::to_string(tokens));
    for (int64_t i = 1; i < n; i++) TANDEM_REQUIRE(*this, values[i] >= values[i - 1], name, "must not decrease");
  }

 private:
  const char *op_;
};

const OptionalTensor kNone;

template <typename T>
const T *pointer(const OptionalTensor &t) {
  return t.has_value() ? t->data_ptr<T>() : nullptr;
}

bool bf16(const Tensor &t) { return t.scalar_type() == ScalarType::BFloat16; }

int threads() { return at::get_num_threads(); }

void ssm_state_update(const Tensor &states, const Tensor &slots, const Tensor &x, const Tensor &dt,
                      const OptionalTensor &dt_bias, bool clamp, double dt_min, double dt_max, const Tensor &A,
                      const Tensor &B, const Tensor &C, const Tensor &D, const Tensor &y,
                      at::OptionalIntArrayRef waves) {
  const Args args("ssm_state_update");
  args.tensor("x", x, kNative, 3);
  args.tensor("B", B, kNative, 3);
  const int64_t rows = x.size(0), heads = x.size(1), head_dim = x.size(2), groups = B.size(1), d_state = B.size(2);
  args.contiguous_from("x", x, 1);
  args.tensor("states", states, kNative, 4);
  args.shape("states", states, {states.size(0), heads, head_dim, d_state});
  args.contiguous_from("states", states, 2);
  const int64_t seqs = args.chains(slots, waves, rows, states.size(0));
  args.tensor("dt", dt, kNative, 2);
  args.same_dtype("dt", dt, x, "x");
  args.shape("dt", dt, {rows, heads});
  args.contiguous_from("dt", dt, 1);
  args.optional("dt_bias", dt_bias, ScalarType::Float, {heads});
  args.tensor("A", A, {ScalarType::Float}, 1);
  args.shape("A", A, {heads});
  args.contiguous("A", A);
  args.same_dtype("B", B, x, "x");
  args.shape("B", B, {rows, groups, d_state});
  args.contiguous_from("B", B, 1);
  TANDEM_REQUIRE(args, groups > 0 && heads % groups == 0, "B", "must have a number of groups that divides the heads");
  args.tensor("C", C, kNative, 3);
  args.same_dtype("C", C, x, "x");
  args.shape("C", C, {rows, groups, d_state});
  args.contiguous_from("C", C, 1);
  args.tensor("D", D, {ScalarType::Float}, 2);
  args.shape("D", D, {heads, head_dim});
  args.contiguous("D", D);
  args.tensor("y", y, kNative, 3);
  args.shape("y", y, {rows, heads, head_dim});
  args.contiguous("y", y);
  tandem_ssm_state_update(states.data_ptr(), bf16(states), states.stride(0), states.stride(1),
                          slots.data_ptr<int64_t>(), args.count("waves", seqs),
                          waves.has_value() ? waves->data() : nullptr,
                          args.count("waves", waves.has_value() ? waves->size() : 1), args.count("x", heads),
                          args.count("x", head_dim), args.count("B", d_state), args.count("B", groups), bf16(x),
                          x.data_ptr(), x.stride(0), dt.data_ptr(), dt.stride(0), pointer<float>(dt_bias), clamp,
                          static_cast<float>(dt_min), static_cast<float>(dt_max), A.data_ptr<float>(), B.data_ptr(),
                          B.stride(0), C.data_ptr(), C.stride(0), D.data_ptr<float>(), y.data_ptr(), bf16(y),
                          threads());
}

// Rows of one float32 or bfloat16 dtype, contiguous within each row, of the shape of `like`.
void rows_like(const Args &args, const char *name, const Tensor &t, const Tensor &like, const char *like_name) {
  args.tensor(name, t, kNative, like.dim());
  args.same_dtype(name, t, like, like_name);
  args.shape(name, t, like.sizes());
  args.contiguous_from(name, t, like.dim() - 1);
}

// The short conv's tensors: x (rows, dim), its taps (dim, width), or (width, dim) when `transposed`, the
// states (slots, width - 1, dim), the bias (dim) and out, of x's shape and dtype. Returns the width.
int64_t check_conv(const Args &args, const Tensor &x, const char *weight_name, const Tensor &weight, bool transposed,
                   const Tensor &states, const OptionalTensor &bias, const Tensor &out) {
  args.tensor("x", x, kNative, 2);
  args.contiguous_from("x", x, 1);
  const int64_t dim = x.size(1);
  args.tensor(weight_name, weight, {ScalarType::Float}, 2);
  const int64_t width = weight.size(transposed ? 0 : 1);
  TANDEM_REQUIRE(args, weight.size(transposed ? 1 : 0) == dim && width >= 1, weight_name,
                 std::string("must have shape ") + (transposed ? "[width, dim]" : "[dim, width]") + " with dim " +
                     std::to_string(dim) + ", got " + c10::str(weight.sizes()));
  args.contiguous(weight_name, weight);
  args.tensor("states", states, kNative, 3);
  args.shape("states", states, {states.size(0), width - 1, dim});
  args.contiguous_from("states", states, 1);
  args.optional("bias", bias, ScalarType::Float, {dim});
  rows_like(args, "out", out, x, "x");
  args.contiguous("out", out);
  return width;
}

void conv_update(const Tensor &states, const Tensor &slots, const Tensor &x, const Tensor &weight,
                 const OptionalTensor &bias, bool silu, const Tensor &out, at::OptionalIntArrayRef waves) {
  const Args args("conv_update");
  const int64_t width = check_conv(args, x, "weight", weight, false, states, bias, out);
  const int64_t rows = x.size(0), dim = x.size(1);
  const int64_t seqs = args.chains(slots, waves, rows, states.size(0));
  tandem_conv_update(states.data_ptr(), bf16(states), states.stride(0), slots.data_ptr<int64_t>(),
                     args.count("waves", seqs), waves.has_value() ? waves->data() : nullptr,
                     args.count("waves", waves.has_value() ? waves->size() : 1), args.count("x", dim),
                     args.count("weight", width), x.data_ptr(), bf16(x), x.stride(0), weight.data_ptr<float>(),
                     pointer<float>(bias), silu, out.data_ptr(), threads());
}

// The per-sequence arrays of a prefill: slots (int64), token offsets (int32), resume flags (uint8).
int prefill_sequences(const Args &args, const Tensor &slots, const Tensor &starts, const Tensor &resume,
                      int64_t tokens, int64_t num_slots) {
  args.tensor("slots", slots, {ScalarType::Long}, 1);
  args.contiguous("slots", slots);
  const int64_t seqs = slots.size(0);
  args.tensor("starts", starts, {ScalarType::Int}, 1);
  args.shape("starts", starts, {seqs + 1});
  args.contiguous("starts", starts);
  args.tensor("resume", resume, {ScalarType::Byte, ScalarType::Bool}, 1);
  args.shape("resume", resume, {seqs});
  args.contiguous("resume", resume);
  args.slots("slots", slots, num_slots);
  args.starts("starts", starts, tokens);
  return args.count("slots", seqs);
}

void ssm_scan(const Tensor &states, const Tensor &slots, const Tensor &starts, const Tensor &resume, const Tensor &x,
              const Tensor &dt, const Tensor &decays, const Tensor &B, const Tensor &C, const Tensor &D,
              const Tensor &y) {
  const Args args("ssm_scan");
  args.tensor("x", x, kNative, 3);
  args.contiguous_from("x", x, 1);
  args.tensor("B", B, {ScalarType::Float}, 3);
  const int64_t tokens = x.size(0), heads = x.size(1), head_dim = x.size(2), groups = B.size(1),
                d_state = B.size(2);
  args.shape("B", B, {tokens, groups, d_state});
  args.contiguous("B", B);
  TANDEM_REQUIRE(args, groups > 0 && heads % groups == 0, "B", "must have a number of groups that divides the heads");
  args.tensor("C", C, {ScalarType::Float}, 3);
  args.shape("C", C, {tokens, groups, d_state});
  args.contiguous("C", C);
  for (const auto &[name, t] : {std::pair<const char *, const Tensor &>{"dt", dt}, {"decays", decays}}) {
    args.tensor(name, t, {ScalarType::Float}, 2);
    args.shape(name, t, {tokens, heads});
    args.contiguous(name, t);
  }
  args.tensor("D", D, {ScalarType::Float}, 2);
  args.shape("D", D, {heads, head_dim});
  args.contiguous("D", D);
  args.tensor("states", states, kNative, 4);
  args.shape("states", states, {states.size(0), heads, head_dim, d_state});
  args.contiguous_from("states", states, 2);
  args.tensor("y", y, kNative, 3);
  args.shape("y", y, {tokens, heads, head_dim});
  args.contiguous("y", y);
  const int seqs = prefill_sequences(args, slots, starts, resume, tokens, states.size(0));
  tandem_ssm_scan(states.data_ptr(), bf16(states), states.stride(0), states.stride(1), slots.data_ptr<int64_t>(),
                  starts.data_ptr<int32_t>(), static_cast<const uint8_t *>(resume.data_ptr()), seqs,
                  args.count("x", heads), args.count("x", head_dim), args.count("B", d_state),
                  args.count("B", groups), x.data_ptr(), bf16(x), x.stride(0), dt.data_ptr<float>(),
                  decays.data_ptr<float>(), B.data_ptr<float>(), C.data_ptr<float>(), D.data_ptr<float>(),
                  y.data_ptr(), bf16(y), threads());
}

void conv_fn(const Tensor &states, const Tensor &slots, const Tensor &starts, const Tensor &resume, const Tensor &x,
             const Tensor &weight_t, const OptionalTensor &bias, bool silu, const Tensor &out) {
  const Args args("conv_fn");
  const int64_t width = check_conv(args, x, "weight_t", weight_t, true, states, bias, out);
  const int64_t tokens = x.size(0), dim = x.size(1);
  const int seqs = prefill_sequences(args, slots, starts, resume, tokens, states.size(0));
  tandem_conv_fn(states.data_ptr(), bf16(states), states.stride(0), slots.data_ptr<int64_t>(),
                 starts.data_ptr<int32_t>(), static_cast<const uint8_t *>(resume.data_ptr()), seqs,
                 args.count("x", dim), args.count("weight_t", width), x.data_ptr(), bf16(x), x.stride(0),
                 weight_t.data_ptr<float>(), pointer<float>(bias), silu, out.data_ptr(), threads());
}

void rms_norm(const Tensor &x, const OptionalTensor &z, const Tensor &weight, double eps, int64_t group_size,
              const Tensor &out) {
  const Args args("rms_norm");
  args.tensor("x", x, kNative, 2);
  args.contiguous_from("x", x, 1);
  const int64_t rows = x.size(0), dim = x.size(1);
  if (z.has_value()) rows_like(args, "z", *z, x, "x");
  args.tensor("weight", weight, kNative, 1);
  args.same_dtype("weight", weight, x, "x");
  args.shape("weight", weight, {dim});
  args.contiguous("weight", weight);
  TANDEM_REQUIRE(args, group_size > 0 && dim % group_size == 0, "group_size",
                 "must divide the row size " + std::to_string(dim) + ", got " + std::to_string(group_size));
  rows_like(args, "out", out, x, "x");
  args.contiguous("out", out);
  tandem_rms_norm(x.data_ptr(), x.stride(0), z.has_value() ? z->data_ptr() : nullptr, z.has_value() ? z->stride(0) : 0,
                  weight.data_ptr(), out.data_ptr(), bf16(x), args.count("x", rows), args.count("x", dim),
                  args.count("group_size", group_size), static_cast<float>(eps), threads());
}

void rotary(const Tensor &x, const Tensor &cos, const Tensor &sin, const Tensor &out) {
  const Args args("rotary");
  args.tensor("x", x, kNative, 3);
  args.contiguous_from("x", x, 2);
  const int64_t tokens = x.size(0), heads = x.size(1), head_dim = x.size(2);
  args.tensor("cos", cos, kNative, 2);
  args.same_dtype("cos", cos, x, "x");
  const int64_t rotary_dim = cos.size(1);
  args.shape("cos", cos, {tokens, rotary_dim});
  args.contiguous("cos", cos);
  TANDEM_REQUIRE(args, rotary_dim % 2 == 0 && rotary_dim <= head_dim, "cos",
                 "must have an even number of columns, at most the head dim " + std::to_string(head_dim));
  args.tensor("sin", sin, kNative, 2);
  args.same_dtype("sin", sin, x, "x");
  args.shape("sin", sin, cos.sizes());
  args.contiguous("sin", sin);
  rows_like(args, "out", out, x, "x");
  args.contiguous("out", out);
  tandem_rotary(x.data_ptr(), x.stride(0), x.stride(1), cos.data_ptr(), sin.data_ptr(), out.data_ptr(), bf16(x),
                args.count("x", tokens), args.count("x", heads), args.count("x", head_dim),
                args.count("cos", rotary_dim), threads());
}

// x @ weight.T (+ bias) in float32, the weight float32 or bfloat16 as stored: the decode batch's linears.
using Linear = void (*)(const void *, int, const float *, const float *, float *, int, int, int, int);

void linear(const char *op, Linear kernel, int64_t max_rows, const Tensor &weight, const Tensor &x,
            const OptionalTensor &bias, const Tensor &y) {
  const Args args(op);
  args.tensor("weight", weight, kNative, 2);
  args.contiguous("weight", weight);
  const int64_t out_features = weight.size(0), in_features = weight.size(1);
  args.tensor("x", x, {ScalarType::Float}, 2);
  args.contiguous("x", x);
  const int64_t rows = x.size(0);
  args.shape("x", x, {rows, in_features});
  TANDEM_REQUIRE(args, rows <= max_rows, "x",
                 "has " + std::to_string(rows) + " rows, more than " + std::to_string(max_rows));
  args.optional("bias", bias, ScalarType::Float, {out_features});
  args.tensor("y", y, {ScalarType::Float}, 2);
  args.shape("y", y, {rows, out_features});
  args.contiguous("y", y);
  kernel(weight.data_ptr(), bf16(weight), x.data_ptr<float>(), pointer<float>(bias), y.data_ptr<float>(),
         args.count("x", rows), args.count("weight", out_features), args.count("weight", in_features), threads());
}

void gemv(const Tensor &weight, const Tensor &x, const OptionalTensor &bias, const Tensor &y) {
  linear("gemv", tandem_gemv, TANDEM_GEMV_MAX_ROWS, weight, x, bias, y);
}

void small_gemm(const Tensor &weight, const Tensor &x, const OptionalTensor &bias, const Tensor &y) {
  linear("small_gemm", tandem_small_gemm, INT_MAX, weight, x, bias, y);
}

// Weights packed in panels of TANDEM_PANEL features (cpu_native.pack_panels): float32 (panels, K, PANEL),
// bfloat16 (panels, K / 2, PANEL, 2); x in the weights' type with K columns (even for bfloat16).
int64_t check_panels(const Args &args, const Tensor &panels, const Tensor &x, const Tensor &y) {
  args.tensor("panels", panels, kNative, bf16(panels) ? 4 : 3);
  args.contiguous("panels", panels);
  args.tensor("x", x, kNative, 2);
  args.same_dtype("x", x, panels, "panels");
  args.contiguous_from("x", x, 1);
  const int64_t rows = x.size(0), in_features = x.size(1);
  args.tensor("y", y, kNative, 2);
  args.same_dtype("y", y, panels, "panels");
  TANDEM_REQUIRE(args, y.size(0) == rows, "y", "must have a row for each row of x, got shape " + c10::str(y.sizes()));
  args.contiguous("y", y);
  const int64_t out_features = y.size(1), count = (out_features + TANDEM_PANEL - 1) / TANDEM_PANEL;
  if (bf16(panels)) {
    TANDEM_REQUIRE(args, in_features % 2 == 0, "x", "must have an even number of columns with bfloat16 panels");
    args.shape("panels", panels, {count, in_features / 2, TANDEM_PANEL, 2});
  } else {
    args.shape("panels", panels, {count, in_features, TANDEM_PANEL});
  }
  return out_features;
}

void panel_gemm(const Tensor &panels, const Tensor &x, const OptionalTensor &bias, const Tensor &y) {
  const Args args("panel_gemm");
  const int64_t out_features = check_panels(args, panels, x, y);
  args.optional("bias", bias, ScalarType::Float, {out_features});
  const int supported = tandem_panel_gemm_dtypes();
  TANDEM_REQUIRE(args, supported & (bf16(panels) ? 2 : 1), "panels",
                 std::string("has a dtype this CPU's build has no panel kernel for: ") +
                     c10::toString(panels.scalar_type()));
  tandem_panel_gemm(panels.data_ptr(), bf16(panels), x.data_ptr(), x.stride(0), pointer<float>(bias), y.data_ptr(),
                    bf16(y), args.count("x", x.size(0)), args.count("y", out_features), args.count("x", x.size(1)),
                    threads());
}

void amx_gemm(const Tensor &panels, const Tensor &x, const OptionalTensor &bias, const Tensor &y) {
  const Args args("amx_gemm");
  args.tensor("panels", panels, {ScalarType::BFloat16}, 4);
  const int64_t out_features = check_panels(args, panels, x, y);
  TANDEM_REQUIRE(args, x.size(1) % TANDEM_AMX_K_MULTIPLE == 0, "x",
                 "must have a multiple of " + std::to_string(TANDEM_AMX_K_MULTIPLE) + " columns, got " +
                     std::to_string(x.size(1)));
  args.optional("bias", bias, ScalarType::Float, {out_features});
  TANDEM_REQUIRE(args, tandem_amx_ready(), "panels",
                 "cannot run on AMX tiles here (no AMX, or Linux refused its state)");
  tandem_amx_gemm(static_cast<const uint16_t *>(panels.data_ptr()), static_cast<const uint16_t *>(x.data_ptr()),
                  x.stride(0), pointer<float>(bias), static_cast<uint16_t *>(y.data_ptr()),
                  args.count("x", x.size(0)), args.count("y", out_features), args.count("x", x.size(1)), threads());
}

// Weight-only quantized linears (quant.c): qweight's dtype names the format, int8 (N, K), uint8 int4 (N,
// ceil(K / 16) * 8) holding blocks of 16 values in 8 bytes, or float8_e4m3fn (N, K); scales and offsets (optional)
// float32 (N, ceil(K / group_size)). The quant.c format code, after checking qweight, scales and offsets.
int check_quant(const Args &args, const Tensor &qweight, const Tensor &scales, const OptionalTensor &offsets,
                int64_t group_size, int64_t in_features) {
  args.tensor("qweight", qweight, {ScalarType::Char, ScalarType::Byte, ScalarType::Float8_e4m3fn}, 2);
  args.contiguous("qweight", qweight);
  const ScalarType dtype = qweight.scalar_type();
  const int format = dtype == ScalarType::Char   ? TANDEM_QUANT_INT8
                     : dtype == ScalarType::Byte ? TANDEM_QUANT_INT4
                                                 : TANDEM_QUANT_FP8;
  const int64_t out_features = qweight.size(0);
  const int64_t blocks = (in_features + TANDEM_INT4_BLOCK - 1) / TANDEM_INT4_BLOCK;
  args.shape("qweight", qweight,
             {out_features, format == TANDEM_QUANT_INT4 ? blocks * TANDEM_INT4_BLOCK / 2 : in_features});
  TANDEM_REQUIRE(args, group_size > 0 && group_size <= INT_MAX, "group_size",
                 "must be positive, got " + std::to_string(group_size));
  TANDEM_REQUIRE(args,
                 format != TANDEM_QUANT_INT4 || group_size % TANDEM_INT4_BLOCK == 0 || group_size >= in_features,
                 "group_size",
                 "must be a multiple of " + std::to_string(TANDEM_INT4_BLOCK) +
                     " for int4 (whole blocks) or span the row, got " + std::to_string(group_size));
  const int64_t groups = (in_features + group_size - 1) / group_size;
  args.tensor("scales", scales, {ScalarType::Float}, 2);
  args.shape("scales", scales, {out_features, groups});
  args.contiguous("scales", scales);
  args.optional("offsets", offsets, ScalarType::Float, {out_features, groups});
  return format;
}

// A quantized linear's x (M, K), bias and y (M, N), beside check_quant's weights: the quant.c format code.
int check_quant_linear(const Args &args, const Tensor &qweight, const Tensor &scales, const OptionalTensor &offsets,
                       int64_t group_size, const Tensor &x, const OptionalTensor &bias, const Tensor &y) {
  args.tensor("x", x, {ScalarType::Float, ScalarType::BFloat16}, 2);
  args.contiguous("x", x);
  const int64_t out_features = qweight.size(0);
  const int format = check_quant(args, qweight, scales, offsets, group_size, x.size(1));
  args.optional("bias", bias, ScalarType::Float, {out_features});
  args.tensor("y", y, {x.scalar_type()}, 2);  // a bfloat16 x gives a bfloat16 y
  args.shape("y", y, {x.size(0), out_features});
  args.contiguous("y", y);
  return format;
}

void quant_gemm(const Tensor &qweight, const Tensor &scales, const OptionalTensor &offsets, int64_t group_size,
                const Tensor &x, const OptionalTensor &bias, const Tensor &y) {
  const Args args("quant_gemm");
  const int format = check_quant_linear(args, qweight, scales, offsets, group_size, x, bias, y);
  const auto *w = static_cast<const uint8_t *>(qweight.data_ptr());
  const int m = args.count("x", x.size(0)), n = args.count("qweight", qweight.size(0)), k = args.count("x", x.size(1));
  if (x.scalar_type() == ScalarType::BFloat16)
    tandem_quant_gemm_bf16(w, format, scales.data_ptr<float>(), pointer<float>(offsets), static_cast<int>(group_size),
                           static_cast<const uint16_t *>(x.data_ptr()), pointer<float>(bias),
                           static_cast<uint16_t *>(y.data_ptr()), m, n, k, threads());
  else
    tandem_quant_gemm(w, format, scales.data_ptr<float>(), pointer<float>(offsets), static_cast<int>(group_size),
                      x.data_ptr<float>(), pointer<float>(bias), y.data_ptr<float>(), m, n, k, threads());
}

// quant_gemm for int4 weights against x quantized to integers in blocks of 32 (quant_x16.c): K a multiple of 64, groups
// multiples of 64, of 32, or the whole row.
void quant_x16_gemm(const Tensor &qweight, const Tensor &scales, const OptionalTensor &offsets, int64_t group_size,
                    const Tensor &x, const OptionalTensor &bias, const Tensor &y) {
  const Args args("quant_x16_gemm");
  const int format = check_quant_linear(args, qweight, scales, offsets, group_size, x, bias, y);
  const int64_t in_features = x.size(1);
  TANDEM_REQUIRE(args, format == TANDEM_QUANT_INT4, "qweight", "must hold int4 weights (uint8)");
  TANDEM_REQUIRE(args, in_features > 0 && in_features % 64 == 0, "x",
                 "must have a multiple of 64 columns, got " + std::to_string(in_features));
  TANDEM_REQUIRE(args, tandem_quant_x16_runs(format, static_cast<int>(group_size), static_cast<int>(in_features)),
                 "group_size", "must be a multiple of 64 or 32, or span the row, got " + std::to_string(group_size));
  const auto *w = static_cast<const uint8_t *>(qweight.data_ptr());
  const int m = args.count("x", x.size(0)), n = args.count("qweight", qweight.size(0));
  const int k = args.count("x", in_features);
  if (x.scalar_type() == ScalarType::BFloat16)
    tandem_quant_x16_gemm_bf16(w, scales.data_ptr<float>(), pointer<float>(offsets), static_cast<int>(group_size),
                               static_cast<const uint16_t *>(x.data_ptr()), pointer<float>(bias),
                               static_cast<uint16_t *>(y.data_ptr()), m, n, k, threads());
  else
    tandem_quant_x16_gemm(w, scales.data_ptr<float>(), pointer<float>(offsets), static_cast<int>(group_size),
                          x.data_ptr<float>(), pointer<float>(bias), y.data_ptr<float>(), m, n, k, threads());
}

// quant_gemm for a bfloat16 x on AMX tiles (int8 and int4 without offsets; K and group_size multiples of 32).
void amx_quant_gemm(const Tensor &qweight, const Tensor &scales, int64_t group_size, const Tensor &x,
                    const OptionalTensor &bias, const Tensor &y) {
  const Args args("amx_quant_gemm");
  args.tensor("x", x, {ScalarType::BFloat16}, 2);
  args.contiguous_from("x", x, 1);  // its rows: any row stride
  const int64_t rows = x.size(0), in_features = x.size(1), out_features = qweight.size(0);
  const int format = check_quant(args, qweight, scales, OptionalTensor(), group_size, in_features);
  TANDEM_REQUIRE(args, format != TANDEM_QUANT_FP8, "qweight", "must be int8 or int4, got float8_e4m3fn");
  TANDEM_REQUIRE(args, in_features % TANDEM_AMX_K_MULTIPLE == 0, "x",
                 "must have a multiple of " + std::to_string(TANDEM_AMX_K_MULTIPLE) + " columns, got " +
                     std::to_string(in_features));
  TANDEM_REQUIRE(args, group_size % TANDEM_AMX_K_MULTIPLE == 0 || group_size >= in_features, "group_size",
                 "must be a multiple of " + std::to_string(TANDEM_AMX_K_MULTIPLE) + " or span the row, got " +
                     std::to_string(group_size));
  args.optional("bias", bias, ScalarType::Float, {out_features});
  args.tensor("y", y, {ScalarType::Float}, 2);
  args.shape("y", y, {rows, out_features});
  args.contiguous("y", y);
  TANDEM_REQUIRE(args, tandem_amx_ready(), "x", "cannot run on AMX tiles here (no AMX, or Linux refused its state)");
  tandem_amx_quant_gemm(static_cast<const uint8_t *>(qweight.data_ptr()), format, scales.data_ptr<float>(),
                        static_cast<int>(group_size), static_cast<const uint16_t *>(x.data_ptr()), x.stride(0),
                        pointer<float>(bias), y.data_ptr<float>(), args.count("x", rows),
                        args.count("qweight", out_features), args.count("x", in_features), threads());
}

// The weight quant_gemm reads, dequantized into out: float32 (N, K).
void quant_dequantize(const Tensor &qweight, const Tensor &scales, const OptionalTensor &offsets,
                      int64_t group_size, const Tensor &out) {
  const Args args("quant_dequantize");
  args.tensor("out", out, {ScalarType::Float}, 2);
  args.contiguous("out", out);
  const int format = check_quant(args, qweight, scales, offsets, group_size, out.size(1));
  args.shape("out", out, {qweight.size(0), out.size(1)});
  tandem_quant_dequantize(static_cast<const uint8_t *>(qweight.data_ptr()), format, scales.data_ptr<float>(),
                          pointer<float>(offsets), static_cast<int>(group_size), out.data_ptr<float>(),
                          args.count("out", out.size(0)), args.count("out", out.size(1)), threads());
}

// A paged cache: (pages, block_size, kv_heads, head_dim), each head's row contiguous.
void check_cache(const Args &args, const char *name, const Tensor &cache, const Tensor &like,
                 std::initializer_list<ScalarType> dtypes) {
  args.tensor(name, cache, dtypes, 4);
  args.contiguous_from(name, cache, 3);
  if (&cache == &like) return;
  args.same_dtype(name, cache, like, "k_cache");
  args.shape(name, cache, like.sizes());
  TANDEM_REQUIRE(args, cache.strides() == like.strides(), name, "must have the strides of 'k_cache'");
}

void decode_attention(const Tensor &q, bool q_bf16, const Tensor &k_cache, const Tensor &v_cache,
                      const Tensor &block_table, const Tensor &seq_lens, double scale, const Tensor &out) {
  const Args args("decode_attention");
  args.tensor("q", q, {ScalarType::Float}, 3);
  args.contiguous("q", q);
  const int64_t seqs = q.size(0), q_heads = q.size(1), head_dim = q.size(2);
  check_cache(args, "k_cache", k_cache, k_cache, kNative);
  check_cache(args, "v_cache", v_cache, k_cache, kNative);
  const int64_t pages = k_cache.size(0), block_size = k_cache.size(1), kv_heads = k_cache.size(2);
  TANDEM_REQUIRE(args, k_cache.size(3) == head_dim, "k_cache",
                 "must have the head dim of 'q', " + std::to_string(head_dim));
  TANDEM_REQUIRE(args, kv_heads > 0 && q_heads % kv_heads == 0, "q", "must have a multiple of the caches' KV heads");
  args.tensor("block_table", block_table, {ScalarType::Int}, 2);
  TANDEM_REQUIRE(args, block_table.size(0) == seqs, "block_table", "must have a row for each sequence of 'q'");
  args.contiguous_from("block_table", block_table, 1);
  args.tensor("seq_lens", seq_lens, {ScalarType::Int}, 1);
  args.shape("seq_lens", seq_lens, {seqs});
  args.contiguous("seq_lens", seq_lens);
  args.tensor("out", out, {ScalarType::Float}, 3);
  args.shape("out", out, q.sizes());
  args.contiguous("out", out);
  const int32_t *lengths = seq_lens.data_ptr<int32_t>();
  for (int64_t s = 0; s < seqs; s++) {
    TANDEM_REQUIRE(args, lengths[s] >= 1 && lengths[s] <= block_table.size(1) * block_size, "seq_lens",
                   "holds " + std::to_string(lengths[s]) + ", outside the block table's 1 to " +
                       std::to_string(block_table.size(1) * block_size) + " positions");
    const int32_t *row = block_table.data_ptr<int32_t>() + s * block_table.stride(0);
    for (int64_t b = 0; b < (lengths[s] + block_size - 1) / block_size; b++)
      TANDEM_REQUIRE(args, row[b] >= 0 && row[b] < pages, "block_table",
                     "holds page " + std::to_string(row[b]) + ", outside the cache's " + std::to_string(pages));
  }
  tandem_decode_attention(k_cache.data_ptr(), v_cache.data_ptr(), bf16(k_cache), k_cache.stride(0), k_cache.stride(1),
                          k_cache.stride(2), args.count("k_cache", block_size), block_table.data_ptr<int32_t>(),
                          block_table.stride(0), lengths, args.count("q", seqs), args.count("q", q_heads),
                          args.count("k_cache", kv_heads), args.count("q", head_dim), q.data_ptr<float>(), q_bf16,
                          static_cast<float>(scale), out.data_ptr<float>(), threads());
}

void silu_and_mul(const Tensor &gate, const Tensor &up, const Tensor &out) {
  const Args args("silu_and_mul");
  args.tensor("gate", gate, kNative, 2);
  args.contiguous_from("gate", gate, 1);
  rows_like(args, "up", up, gate, "gate");
  rows_like(args, "out", out, gate, "gate");
  args.contiguous("out", out);
  tandem_silu_and_mul(gate.data_ptr(), gate.stride(0), up.data_ptr(), up.stride(0), out.data_ptr(), bf16(gate),
                      args.count("gate", gate.size(0)), args.count("gate", gate.size(1)), threads());
}

void store_kv(const Tensor &key, const Tensor &value, const Tensor &k_cache, const Tensor &v_cache,
              const Tensor &slots) {
  const Args args("store_kv");
  const auto any = {key.scalar_type()};  // row copies: any dtype, the same everywhere
  args.tensor("key", key, any, 3);
  args.contiguous_from("key", key, 2);
  const int64_t tokens = key.size(0), kv_heads = key.size(1), head_dim = key.size(2);
  args.tensor("value", value, any, 3);
  args.shape("value", value, key.sizes());
  args.contiguous_from("value", value, 2);
  check_cache(args, "k_cache", k_cache, k_cache, any);
  check_cache(args, "v_cache", v_cache, k_cache, any);
  TANDEM_REQUIRE(args, k_cache.size(2) == kv_heads && k_cache.size(3) == head_dim, "k_cache",
                 "must have the KV heads and head dim of 'key', got shape " + c10::str(k_cache.sizes()));
  args.tensor("slots", slots, {ScalarType::Long}, 1);
  args.shape("slots", slots, {tokens});
  args.contiguous("slots", slots);
  args.slots("slots", slots, k_cache.size(0) * k_cache.size(1));
  tandem_store_kv(key.data_ptr(), key.stride(0), key.stride(1), value.data_ptr(), value.stride(0), value.stride(1),
                  k_cache.data_ptr(), v_cache.data_ptr(), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
                  args.count("k_cache", k_cache.size(1)), slots.data_ptr<int64_t>(), args.count("key", tokens),
                  args.count("key", kv_heads), args.count("key", head_dim), static_cast<int>(key.element_size()),
                  threads());
}

int64_t panel_gemm_dtypes() { return tandem_panel_gemm_dtypes(); }

bool amx_ready() { return tandem_amx_ready() != 0; }

bool quant_expands() { return tandem_quant_expands() != 0; }

// Batched LoRA (lora.c). The pools are (S, R, in), (S, R, out) in float32 or bfloat16 (the model's) and a float32
// bias (S, out); the last slot is the zero slot
// the base model's rows point at, and the kernels skip those rows.
void lora_indices(const Args &args, const Tensor &indices, int64_t rows, int64_t slots) {
  args.tensor("indices", indices, {ScalarType::Long}, 1);
  args.shape("indices", indices, {rows});
  args.contiguous("indices", indices);
  args.slots("indices", indices, slots);
  const int64_t *values = indices.data_ptr<int64_t>();
  for (int64_t i = 0; i < rows; i++)
    TANDEM_REQUIRE(args, values[i] >= 0, "indices", "holds -1 at " + std::to_string(i) + "; the zero slot is the last");
}

void lora_shrink(const Tensor &x, const Tensor &lora_a, const Tensor &indices, const Tensor &out) {
  const Args args("lora_shrink");
  args.tensor("x", x, kNative, 2);
  args.contiguous_from("x", x, 1);
  args.tensor("lora_a", lora_a, kNative, 3);
  args.contiguous("lora_a", lora_a);
  args.shape("lora_a", lora_a, {lora_a.size(0), lora_a.size(1), x.size(1)});
  lora_indices(args, indices, x.size(0), lora_a.size(0));
  args.tensor("out", out, {ScalarType::Float}, 2);
  args.shape("out", out, {x.size(0), lora_a.size(1)});
  args.contiguous("out", out);
  tandem_lora_shrink(x.data_ptr(), bf16(x), x.stride(0), lora_a.data_ptr(), bf16(lora_a), indices.data_ptr<int64_t>(),
                     lora_a.size(0) - 1, args.count("x", x.size(0)), args.count("lora_a", lora_a.size(1)),
                     args.count("x", x.size(1)), out.data_ptr<float>(), threads());
}

void lora_expand(const Tensor &s, const Tensor &lora_b, const Tensor &lora_bias, const Tensor &indices,
                 const Tensor &y) {
  const Args args("lora_expand");
  args.tensor("s", s, {ScalarType::Float}, 2);
  args.contiguous("s", s);
  args.tensor("lora_b", lora_b, kNative, 3);
  args.contiguous("lora_b", lora_b);
  args.shape("lora_b", lora_b, {lora_b.size(0), s.size(1), lora_b.size(2)});
  args.tensor("lora_bias", lora_bias, {ScalarType::Float}, 2);
  args.shape("lora_bias", lora_bias, {lora_b.size(0), lora_b.size(2)});
  args.contiguous("lora_bias", lora_bias);
  lora_indices(args, indices, s.size(0), lora_b.size(0));
  args.tensor("y", y, kNative, 2);
  args.shape("y", y, {s.size(0), lora_b.size(2)});
  args.contiguous_from("y", y, 1);
  tandem_lora_expand(s.data_ptr<float>(), lora_b.data_ptr(), bf16(lora_b), lora_bias.data_ptr<float>(),
                     indices.data_ptr<int64_t>(), lora_b.size(0) - 1, args.count("s", s.size(0)),
                     args.count("s", s.size(1)), args.count("lora_b", lora_b.size(2)), y.data_ptr(), bf16(y),
                     y.stride(0), threads());
}


}  // namespace

TORCH_LIBRARY(tandem, m) {
  m.def("ssm_state_update(Tensor(a!) states, Tensor slots, Tensor x, Tensor dt, Tensor? dt_bias, bool clamp, "
        "float dt_min, float dt_max, Tensor A, Tensor B, Tensor C, Tensor D, Tensor(b!) y, int[]? waves=None) -> ()");
  m.def("conv_update(Tensor(a!) states, Tensor slots, Tensor x, Tensor weight, Tensor? bias, bool silu, "
        "Tensor(b!) out, int[]? waves=None) -> ()");
  m.def("ssm_scan(Tensor(a!) states, Tensor slots, Tensor starts, Tensor resume, Tensor x, Tensor dt, "
        "Tensor decays, Tensor B, Tensor C, Tensor D, Tensor(b!) y) -> ()");
  m.def("conv_fn(Tensor(a!) states, Tensor slots, Tensor starts, Tensor resume, Tensor x, Tensor weight_t, "
        "Tensor? bias, bool silu, Tensor(b!) out) -> ()");
  m.def("rms_norm(Tensor x, Tensor? z, Tensor weight, float eps, int group_size, Tensor(a!) out) -> ()");
  m.def("rotary(Tensor x, Tensor cos, Tensor sin, Tensor(a!) out) -> ()");
  m.def("gemv(Tensor weight, Tensor x, Tensor? bias, Tensor(a!) y) -> ()");
  m.def("small_gemm(Tensor weight, Tensor x, Tensor? bias, Tensor(a!) y) -> ()");
  m.def("panel_gemm(Tensor panels, Tensor x, Tensor? bias, Tensor(a!) y) -> ()");
  m.def("amx_gemm(Tensor panels, Tensor x, Tensor? bias, Tensor(a!) y) -> ()");
  m.def("quant_gemm(Tensor qweight, Tensor scales, Tensor? offsets, int group_size, Tensor x, Tensor? bias, "
        "Tensor(a!) y) -> ()");
  m.def("quant_x16_gemm(Tensor qweight, Tensor scales, Tensor? offsets, int group_size, Tensor x, Tensor? bias, "
        "Tensor(a!) y) -> ()");
  m.def("quant_dequantize(Tensor qweight, Tensor scales, Tensor? offsets, int group_size, Tensor(a!) out) -> ()");
  m.def("amx_quant_gemm(Tensor qweight, Tensor scales, int group_size, Tensor x, Tensor? bias, Tensor(a!) y) -> ()");
  m.def("decode_attention(Tensor q, bool q_bf16, Tensor k_cache, Tensor v_cache, Tensor block_table, "
        "Tensor seq_lens, float scale, Tensor(a!) out) -> ()");
  m.def("silu_and_mul(Tensor gate, Tensor up, Tensor(a!) out) -> ()");
  m.def("store_kv(Tensor key, Tensor value, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor slots) -> ()");
  // What this build runs, for the launchers' choices: no tensors, so one kernel for every dispatch key.
  m.def("panel_gemm_dtypes() -> int", &panel_gemm_dtypes);
  m.def("amx_ready() -> bool", &amx_ready);
  m.def("quant_expands() -> bool", &quant_expands);
  m.def("lora_shrink(Tensor x, Tensor lora_a, Tensor indices, Tensor(a!) out) -> ()");
  m.def("lora_expand(Tensor s, Tensor lora_b, Tensor lora_bias, Tensor indices, Tensor(a!) y) -> ()");
}

TORCH_LIBRARY_IMPL(tandem, CPU, m) {
  m.impl("ssm_state_update", &ssm_state_update);
  m.impl("conv_update", &conv_update);
  m.impl("ssm_scan", &ssm_scan);
  m.impl("conv_fn", &conv_fn);
  m.impl("rms_norm", &rms_norm);
  m.impl("rotary", &rotary);
  m.impl("gemv", &gemv);
  m.impl("small_gemm", &small_gemm);
  m.impl("panel_gemm", &panel_gemm);
  m.impl("amx_gemm", &amx_gemm);
  m.impl("quant_gemm", &quant_gemm);
  m.impl("quant_x16_gemm", &quant_x16_gemm);
  m.impl("quant_dequantize", &quant_dequantize);
  m.impl("amx_quant_gemm", &amx_quant_gemm);
  m.impl("decode_attention", &decode_attention);
  m.impl("silu_and_mul", &silu_and_mul);
  m.impl("store_kv", &store_kv);
  m.impl("lora_shrink", &lora_shrink);
  m.impl("lora_expand", &lora_expand);
}
