// The corrected layers' autograd nodes in C++, so that a call pays no Python autograd.Function.
//
//     affine_like(x, W, b)        (z, r)   z = r·(x Wᵀ + b),   r = 1/√(‖x‖² + 1) per row
//     norm_like(x, W, b, k, eps)  (z, q)   z = q·(x Wᵀ) + b,   q = k/max(‖x‖, eps) per row
//     patchnorm_conv(x, W, b, …)  z        z = r·(conv(x, W) + b), r = 1/√(‖P‖² + 1) per group and position
//
// The dense nodes are AffineLikeFunction / NormLikeFunction of _autograd.py, branch for branch: the
// fused row passes of _fused_cpu.c around the GEMMs where they may run (bound by name from that
// library, which affdiv.layers._fused loaded; every tensor contiguous and plain, no graph being
// recorded, no dispatch mode, no tangent), else the plain-torch passes, the same ops in the same
// order. So the same numbers to the bit as the Python Functions, the same saved tensors (the scale
// is an output and is saved as one, so a double backward sees its dependence on x through grad_r /
// grad_q) and the same overflow-safe rescaling as _scale.prepare. The derivations are in those
// classes' docstrings. A node's backward computes the gradients its backward asks for (a Python
// Function's, those whose inputs required one at forward time): the same numbers. x is 2-D
// (rows, in), every tensor a float32/float64 CPU tensor of one dtype (`servable` checks it before
// a node runs). Forward-mode AD and the torch.func transforms stay with the Python Functions,
// which have jvp and vmap rules; the backward here is differentiable (create_graph records its
// plain-torch ops).
//
// The PatchNorm convolution's node is PatchNormConvFunction's fused branch: a 4-D x whose squares
// sum finitely (no rescaling), its passes and convolutions as that Function calls them, so the
// same numbers to the bit; its output z held for backward as that Function holds it (a detached
// alias and its version). Every other branch stays in Python: a call that needs one is not served
// (`patchnorm_conv` returns None), and a backward that needs one (a gradient of r, a graph being
// recorded, z changed in place since the forward, a tensor the passes may not take) calls
// _autograd.patchnorm_conv_grads, the Function's own backward, under the GIL.
#include <torch/extension.h>
#include <torch/version.h>

#include <ATen/MemoryOverlap.h>
#include <c10/core/impl/TorchDispatchModeTLS.h>
#include <dlfcn.h>
#include <torch/csrc/jit/frontend/tracer.h>

#include <atomic>
#include <cmath>
#include <limits>
#include <optional>
#include <string>
#include <type_traits>

#include "_fused_cpu.h"

namespace affdiv {  // (named: a node's name, CppNode<affdiv::AffineLikeFunction>, is what profilers show)

using torch::Tensor;
using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// ------------------------------------------------------------------------------------------
// the fused passes (their prototypes in _fused_cpu.h)

template <typename T>
struct Passes {
    // the dense layers' row passes
    int64_t (*scale_outputs)(T*, const T*, int64_t, int64_t, int64_t, int, double, double, double, double, const T*,
                             const T*, T*, int) = nullptr;
    int (*scale_grad)(const T*, const T*, int64_t, int64_t, T*, T*, int, const T*, T*, int) = nullptr;
    void (*minus_radial)(T*, const T*, int64_t, int64_t, const T*, double, double, const T*, int) = nullptr;
    // the PatchNorm convolution's, [0] for contiguous tensors, [1] for channels_last ones
    int64_t (*group_squares[2])(const T*, int64_t, int64_t, int64_t, int64_t, double, T*, int) = {};
    void (*scale_and_dot[2])(const T*, const T*, const T*, int64_t, int64_t, int64_t, int64_t, T*, T*, int) = {};
    void (*group_update[2])(T*, const T*, const T*, int64_t, int64_t, int64_t, int64_t, int) = {};
    void (*box)(const T*, T*, int64_t, const int64_t*, int, int) = nullptr;
    void (*scale_and_dot_to_cl)(const T*, const T*, const T*, int64_t, int64_t, int64_t, int64_t, T*, T*,
                                int) = nullptr;
    void (*group_update_from_cl)(const T*, const T*, const T*, int64_t, int64_t, int64_t, int64_t, T*, int) = nullptr;
};
#define AFFDIV_SAME_TYPE(field, function)                                                                 \
    std::is_same_v<std::remove_reference_t<decltype(Passes<float>::field)>, decltype(&function##_f32)> &&  \
        std::is_same_v<std::remove_reference_t<decltype(Passes<double>::field)>, decltype(&function##_f64)>
static_assert(AFFDIV_SAME_TYPE(scale_outputs, scale_outputs) && AFFDIV_SAME_TYPE(scale_grad, scale_grad) &&
              AFFDIV_SAME_TYPE(minus_radial, minus_radial) && AFFDIV_SAME_TYPE(group_squares[0], group_squares) &&
              AFFDIV_SAME_TYPE(group_squares[1], group_squares_cl) &&
              AFFDIV_SAME_TYPE(scale_and_dot[0], scale_and_dot) &&
              AFFDIV_SAME_TYPE(scale_and_dot[1], scale_and_dot_cl) &&
              AFFDIV_SAME_TYPE(group_update[0], group_update) && AFFDIV_SAME_TYPE(group_update[1], group_update_cl) &&
              AFFDIV_SAME_TYPE(box, box) && AFFDIV_SAME_TYPE(scale_and_dot_to_cl, scale_and_dot_to_cl) &&
              AFFDIV_SAME_TYPE(group_update_from_cl, group_update_from_cl),
              "the passes' types must be those of _fused_cpu.h");
#undef AFFDIV_SAME_TYPE

Passes<float> passes_f32;
Passes<double> passes_f64;
// The pointers are written once, by the first bind (at the module's import, before any node runs);
// later binds and unbinds (for tests) only set or clear the flag.
std::atomic<bool> passes_bound{false};

template <typename T>
Passes<T>& passes();
template <>
Passes<float>& passes<float>() { return passes_f32; }
template <>
Passes<double>& passes<double>() { return passes_f64; }

template <typename F>
bool bind_symbol(void* lib, F*& function, const std::string& name) {
    function = reinterpret_cast<F*>(dlsym(lib, name.c_str()));
    return function != nullptr;
}

template <typename T>
bool bind_type(void* lib, const std::string& s) {
    Passes<T>& p = passes<T>();
    return bind_symbol(lib, p.scale_outputs, "scale_outputs_" + s)
           && bind_symbol(lib, p.scale_grad, "scale_grad_" + s)
           && bind_symbol(lib, p.minus_radial, "minus_radial_" + s)
           && bind_symbol(lib, p.group_squares[0], "group_squares_" + s)
           && bind_symbol(lib, p.group_squares[1], "group_squares_cl_" + s)
           && bind_symbol(lib, p.scale_and_dot[0], "scale_and_dot_" + s)
           && bind_symbol(lib, p.scale_and_dot[1], "scale_and_dot_cl_" + s)
           && bind_symbol(lib, p.group_update[0], "group_update_" + s)
           && bind_symbol(lib, p.group_update[1], "group_update_cl_" + s)
           && bind_symbol(lib, p.box, "box_" + s)
           && bind_symbol(lib, p.scale_and_dot_to_cl, "scale_and_dot_to_cl_" + s)
           && bind_symbol(lib, p.group_update_from_cl, "group_update_from_cl_" + s);
}

// Whether the library is of the interface these nodes were compiled with (_fused_cpu.h).
bool same_abi(void* lib) {
    auto abi = reinterpret_cast<int (*)()>(dlsym(lib, "affdiv_fused_abi"));
    return abi != nullptr && abi() == AFFDIV_FUSED_ABI;
}

// Bind the passes of the library at `path`, which must already be loaded (its handle is not
// closed: the library stays for the process; the first path bound is the one used for good) and of
// this interface version; an empty path unbinds them. Returns whether bound.
bool bind_passes(const std::string& path) {
    static bool found = false;  // (written by the first call, at import: no node runs yet)
    static bool looked = false;
    passes_bound = false;
    if (path.empty()) {
        return false;
    }
    if (!looked) {
        looked = true;
        void* lib = dlopen(path.c_str(), RTLD_NOW | RTLD_NOLOAD);
        found = lib != nullptr && same_abi(lib) && bind_type<float>(lib, "f32") && bind_type<double>(lib, "f64");
    }
    passes_bound = found;
    return found;
}

bool passes_are_bound() {
    return passes_bound;
}

// A strided tensor with its own storage, which holds its values as they read: not a Python subclass
// (FakeTensor, …), not wrapped by torch.func or the legacy vmap, not a lazily negated or conjugated
// view (its storage holds the values before the negation), and carrying no forward-mode tangent
// (which a raw kernel would drop). As _fused.plain.
bool plain(const Tensor& t) {
    static const c10::DispatchKeySet wrapped({c10::DispatchKey::Python, c10::DispatchKey::FuncTorchGradWrapper,
                                              c10::DispatchKey::FuncTorchBatched, c10::DispatchKey::Batched});
    return (t.key_set() & wrapped).empty() && t.layout() == at::kStrided && t.has_storage() && !t.is_neg()
           && !t.is_conj() && !t._fw_grad(/*level=*/0).defined();
}

// _fused.usable: the passes may run on these tensors (undefined ones ignored; the first is defined),
// each contiguous in `layout`.
bool passes_usable(std::initializer_list<Tensor> tensors, at::MemoryFormat layout = at::MemoryFormat::Contiguous) {
    if (!passes_bound || at::GradMode::is_enabled() || c10::impl::TorchDispatchModeTLS::stack_len() > 0) {
        return false;
    }
    const auto dtype = tensors.begin()->scalar_type();
    for (const Tensor& t : tensors) {
        if (t.defined() && !(t.scalar_type() == dtype && t.is_cpu() && t.is_contiguous(layout) && plain(t))) {
            return false;
        }
    }
    return true;
}

template <typename T>
const T* ptr_or_null(const Tensor& t) {
    return t.defined() ? t.data_ptr<T>() : nullptr;
}

// _fused.scale_outputs: s (rows, 1), z scaled in place; false where some row is unsafe (module docstring of
// _fused): then z and s must be discarded.
bool scale_outputs(const Tensor& z, const Tensor& x, int mode, double k, double eps, double small, const Tensor& pre,
                   const Tensor& post, const Tensor& s) {
    return AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "scale_outputs", [&] {
        return passes<scalar_t>().scale_outputs(
                   z.data_ptr<scalar_t>(), x.data_ptr<scalar_t>(), x.size(0), x.size(1), z.size(1), mode, k, eps,
                   small, std::numeric_limits<scalar_t>::max(), ptr_or_null<scalar_t>(pre),
                   ptr_or_null<scalar_t>(post), s.data_ptr<scalar_t>(), at::get_num_threads())
               == 0;
    });
}

// _fused.scale_grad: (gy, colsum, dot), gy = s·g row-wise; colsum = Σ_i gy_i ("scaled") or Σ_i g_i
// ("input"), undefined without; dot = ⟨gy_i, v⟩ (rows, 1), undefined without v.
enum class ColumnSum { none, scaled, input };

std::tuple<Tensor, Tensor, Tensor> scale_grad(const Tensor& g, const Tensor& s, ColumnSum column_sum, const Tensor& v) {
    Tensor gy = at::empty_like(g);
    Tensor colsum = column_sum == ColumnSum::none ? Tensor() : at::empty({g.size(1)}, g.options());
    Tensor dot = v.defined() ? at::empty({g.size(0), 1}, g.options()) : Tensor();
    int failed = AT_DISPATCH_FLOATING_TYPES(g.scalar_type(), "scale_grad", [&] {
        return passes<scalar_t>().scale_grad(
            g.data_ptr<scalar_t>(), s.data_ptr<scalar_t>(), g.size(0), g.size(1), gy.data_ptr<scalar_t>(),
            colsum.defined() ? colsum.data_ptr<scalar_t>() : nullptr, column_sum == ColumnSum::input ? 1 : 0,
            ptr_or_null<scalar_t>(v), dot.defined() ? dot.data_ptr<scalar_t>() : nullptr,
            at::get_num_threads());
    });
    TORCH_CHECK(failed == 0, "scale_grad: could not allocate the column-sum partials (", g.size(1), " columns)");
    return {gy, colsum, dot};
}

// _fused.minus_radial_: u_i ← u_i − a_i·(⟨u_i, x_i⟩ + c_i)·x_i in place, a_i = (m·s_i)² where s_i < limit.
Tensor minus_radial_(const Tensor& u, const Tensor& x, const Tensor& s, double m, double limit, const Tensor& c) {
    AT_DISPATCH_FLOATING_TYPES(u.scalar_type(), "minus_radial", [&] {
        passes<scalar_t>().minus_radial(u.data_ptr<scalar_t>(), x.data_ptr<scalar_t>(), u.size(0), u.size(1),
                                        s.data_ptr<scalar_t>(), m, limit, ptr_or_null<scalar_t>(c),
                                        at::get_num_threads());
    });
    return u;
}

// _autograd._dense_grads_fused: (dx, dW, db) of z = s·(x Wᵀ) (+ bias), three row passes around two GEMMs.
variable_list dense_grads_fused(const Tensor& x, const Tensor& weight, const Tensor& s, const Tensor& grad_z,
                                const Tensor& extra, bool need_x, bool need_w, ColumnSum column_sum,
                                const Tensor& bias, double m, double limit) {
    auto [gy, db, beta] = scale_grad(grad_z, s, column_sum, need_x ? bias : Tensor());
    Tensor dx, dw;
    if (need_x) {  // (before dW: the radial pass then finds u in cache)
        Tensor offset = !extra.defined() ? beta : (!beta.defined() ? extra : beta + extra);
        dx = minus_radial_(at::mm(gy, weight), x, s, m, limit, offset);
    }
    if (need_w) {
        dw = at::mm(gy.t(), x);
    }
    return {dx, dw, db};
}

// ------------------------------------------------------------------------------------------
// the plain-torch passes (_scale)

// K of _scale.safe_exponent: 2^±K representable with a margin of 2^(maxexp/4) both ways.
int safe_exponent(at::ScalarType dtype) {
    return dtype == at::kDouble ? 3 * 1024 / 4 : 3 * 128 / 4;
}

// _scale.small_norm: below it ‖x‖² may have lost precision to underflow.
double small_norm(at::ScalarType dtype) {
    double tiny = dtype == at::kDouble ? std::numeric_limits<double>::min() : std::numeric_limits<float>::min();
    return std::sqrt(tiny) * 256.0;
}

Tensor row_norm(const Tensor& x) {
    return at::linalg_vector_norm(x, 2, {-1}, /*keepdim=*/true, x.scalar_type());
}

// _scale.prepare over the rows: (x', c, ‖x'‖, c = 1), x' = c·x, c = 1 unless some norm is not finite
// (or, with small > 0, below small); then c = 1/max(‖x‖, floor) where finite, 2^-K where it overflowed.
std::tuple<Tensor, Tensor, Tensor, bool> prepare(const Tensor& x, double floor, double small) {
    Tensor norm = row_norm(x);
    bool safe = at::isfinite(norm).all().item<bool>() && (small <= 0.0 || at::ge(norm, small).all().item<bool>());
    if (safe) {
        return {x, at::ones_like(norm), norm, true};
    }
    Tensor c = at::where(at::isfinite(norm), norm.clamp_min(floor).reciprocal(),
                         std::ldexp(1.0, -safe_exponent(x.scalar_type())));
    Tensor scaled = x * c;
    return {scaled, c, row_norm(scaled), false};
}

Tensor rowdot(const Tensor& a, const Tensor& b) {
    return (a * b).sum({-1}, /*keepdim=*/true, a.scalar_type());
}

// u − coef·x, in place on u (a temporary of the backward) unless a graph is being recorded through it.
Tensor minus_coef_times(const Tensor& u, const Tensor& coef, const Tensor& x) {
    if (!u.defined()) {
        return -coef * x;
    }
    return u.requires_grad() ? at::addcmul(u, coef, x, -1) : u.addcmul_(coef, x, -1);
}

// ------------------------------------------------------------------------------------------
// the nodes

// (z, r) of AffineLikeFunction.forward.
std::pair<Tensor, Tensor> affine_like_forward(const Tensor& x, const Tensor& weight, const Tensor& bias) {
    if (passes_usable({x, weight, bias})) {
        Tensor z = at::mm(x, weight.t());
        Tensor r = at::empty({x.size(0), 1}, x.options());
        if (scale_outputs(z, x, /*mode=*/0, 1.0, 0.0, 0.0, bias, Tensor(), r)) {  // ‖x‖² finite: c = 1
            return {z, r};
        }
    }
    auto [x_scaled, c, norm, unscaled] = prepare(x, 1.0, 0.0);
    Tensor rho = at::hypot(norm, c).reciprocal();
    Tensor r = rho * c;
    if (unscaled && bias.defined()) {  // c = 1: the bias goes into the GEMM
        return {at::addmm(bias, x, weight.t()).mul_(rho), r};
    }
    Tensor z = at::mm(x_scaled, weight.t()).mul_(rho);
    return {bias.defined() ? at::addcmul(z, r, bias) : z, r};
}

// (dx, dW, db) of AffineLikeFunction.backward (_autograd.affine_like_grads):
// dx = u − r²·(⟨u, x⟩ + ⟨gy, b⟩ + r·g_r)·x,  gy = r·gz,  u = gy W,  dW = gyᵀ x,  db = gzᵀ r.
variable_list affine_like_grads(const Tensor& x, const Tensor& weight, const Tensor& bias, const Tensor& r,
                                Tensor grad_z, const Tensor& grad_r, bool need_x, bool need_w, bool need_b) {
    Tensor dx, dw, db, coef;
    if (grad_z.defined()) {
        grad_z = grad_z.contiguous();
        if (passes_usable({x, weight, bias, r, grad_z, grad_r})) {
            ColumnSum column_sum = need_b ? ColumnSum::scaled : ColumnSum::none;  // db = Σ r·gz
            Tensor extra = grad_r.defined() ? r * grad_r : Tensor();
            return dense_grads_fused(x, weight, r, grad_z, extra, need_x, need_w, column_sum, bias, 1.0,
                                     std::numeric_limits<double>::infinity());
        }
        if (need_b) {
            db = at::mm(grad_z.t(), r).squeeze(-1);
        }
        if (need_w || need_x) {
            Tensor gy = grad_z * r;
            if (need_w) {
                dw = at::mm(gy.t(), x);
            }
            if (need_x) {
                Tensor u = at::mm(gy, weight);
                Tensor dot = rowdot(u, x);
                if (bias.defined()) {
                    dot = dot + at::mm(gy, bias.unsqueeze(-1));
                }
                coef = r * (r * dot);
                dx = u;
            }
        }
    }
    if (grad_r.defined() && need_x) {
        Tensor extra = r * (r * (r * grad_r));
        coef = coef.defined() ? coef + extra : extra;
    }
    if (coef.defined()) {
        dx = minus_coef_times(dx, coef, x);
    }
    return {dx, dw, db};
}

class AffineLikeFunction : public torch::autograd::Function<AffineLikeFunction> {
public:
    static variable_list forward(AutogradContext* ctx, const Tensor& x, const Tensor& weight,
                                 const std::optional<Tensor>& bias) {
        Tensor b = bias.value_or(Tensor());
        auto [z, r] = affine_like_forward(x, weight, b);
        ctx->save_for_backward({x, weight, b, r});
        ctx->set_materialize_grads(false);
        return {z, r};
    }

    static variable_list backward(AutogradContext* ctx, variable_list grads) {
        auto saved = ctx->get_saved_variables();
        const Tensor& bias = saved[2];
        bool need_b = bias.defined() && ctx->needs_input_grad(2);  // (no bias: no index 2 to ask)
        return affine_like_grads(saved[0], saved[1], bias, saved[3], grads[0], grads[1], ctx->needs_input_grad(0),
                                 ctx->needs_input_grad(1), need_b);
    }
};

// (z, q) of NormLikeFunction.forward.
std::pair<Tensor, Tensor> norm_like_forward(const Tensor& x, const Tensor& weight, const Tensor& bias, double k,
                                            double eps) {
    double small = eps >= small_norm(x.scalar_type()) ? 0.0 : small_norm(x.scalar_type());  // 0: none
    if (passes_usable({x, weight, bias})) {
        Tensor z = at::mm(x, weight.t());
        Tensor q = at::empty({x.size(0), 1}, x.options());
        if (scale_outputs(z, x, /*mode=*/1, k, eps, small, Tensor(), bias, q)) {  // no norm overflowed or below small
            return {z, q};
        }
    }
    auto [x_scaled, c, norm, unscaled] = prepare(x, std::ldexp(1.0, -safe_exponent(x.scalar_type())), small);
    Tensor q_scaled = at::maximum(norm, c * eps).reciprocal() * k;
    Tensor z = at::mm(x_scaled, weight.t()).mul_(q_scaled);
    if (bias.defined()) {
        z = z.add_(bias);
    }
    return {z, q_scaled * c};
}

// (dx, dW, db) of NormLikeFunction.backward: where ‖x‖ > eps, p = 1/‖x‖,
// dx = u − p²·(⟨u, x⟩ + q·g_q)·x; elsewhere dx = u (gy = q·gz, u = gy W, dW = gyᵀ x, db = Σ_rows gz).
variable_list norm_like_grads(const Tensor& x, const Tensor& weight, const Tensor& q, double k, double eps,
                              Tensor grad_z, const Tensor& grad_q, bool need_x, bool need_w, bool need_b) {
    if (grad_z.defined()) {
        grad_z = grad_z.contiguous();
        if (passes_usable({x, weight, q, grad_z, grad_q})) {
            ColumnSum column_sum = need_b ? ColumnSum::input : ColumnSum::none;  // db = Σ gz (b is not scaled)
            Tensor extra = grad_q.defined() ? q * grad_q : Tensor();
            return dense_grads_fused(x, weight, q, grad_z, extra, need_x, need_w, column_sum, Tensor(), 1 / k, k / eps);
        }
    }
    Tensor p = at::where(q < k / eps, q / k, 0.0);
    Tensor dx, dw, db, dot;
    if (grad_z.defined()) {
        Tensor gy = grad_z * q;
        if (need_w) {
            dw = at::mm(gy.t(), x);
        }
        if (need_b) {
            db = grad_z.sum(0);
        }
        if (need_x) {
            dx = at::mm(gy, weight);
            dot = rowdot(dx, x);
        }
    }
    if (grad_q.defined() && need_x) {
        dot = dot.defined() ? dot + q * grad_q : q * grad_q;
    }
    if (dot.defined()) {
        dx = minus_coef_times(dx, p * (p * dot), x);
    }
    return {dx, dw, db};
}

class NormLikeFunction : public torch::autograd::Function<NormLikeFunction> {
public:
    static variable_list forward(AutogradContext* ctx, const Tensor& x, const Tensor& weight,
                                 const std::optional<Tensor>& bias, double k, double eps) {
        auto [z, q] = norm_like_forward(x, weight, bias.value_or(Tensor()), k, eps);
        ctx->save_for_backward({x, weight, q});  // db = Σ gz needs no b
        ctx->saved_data["k"] = k;
        ctx->saved_data["eps"] = eps;
        ctx->saved_data["has_bias"] = bias.has_value();
        ctx->set_materialize_grads(false);
        return {z, q};
    }

    static variable_list backward(AutogradContext* ctx, variable_list grads) {
        auto saved = ctx->get_saved_variables();
        bool need_b = ctx->saved_data["has_bias"].toBool() && ctx->needs_input_grad(2);
        variable_list dense = norm_like_grads(saved[0], saved[1], saved[2], ctx->saved_data["k"].toDouble(),
                                              ctx->saved_data["eps"].toDouble(), grads[0], grads[1],
                                              ctx->needs_input_grad(0), ctx->needs_input_grad(1), need_b);
        return {dense[0], dense[1], dense[2], Tensor(), Tensor()};
    }
};

// ------------------------------------------------------------------------------------------
// the PatchNorm convolution (PatchNormConvFunction's fused branch; its docstring has the math)

using Ints = std::vector<int64_t>;

// _fused.layout_of: channels_last for a plain 4-D tensor stored so (and not also contiguous), else
// contiguous (also for a batched gradient, whose layout cannot be asked).
at::MemoryFormat layout_of(const Tensor& t) {
    return plain(t) && t.dim() == 4 && !t.is_contiguous() && t.is_contiguous(at::MemoryFormat::ChannelsLast)
               ? at::MemoryFormat::ChannelsLast
               : at::MemoryFormat::Contiguous;
}

int layout_index(const Tensor& t) {  // the passes' arrays: [0] contiguous, [1] channels_last
    return layout_of(t) == at::MemoryFormat::ChannelsLast ? 1 : 0;
}

int64_t spatial_size(const Tensor& t) {  // math.prod(t.shape[2:])
    int64_t size = 1;
    for (int64_t d = 2; d < t.dim(); ++d) {
        size *= t.size(d);
    }
    return size;
}

Ints with_spatial(const Tensor& t, int64_t dim1, at::IntArrayRef spatial) {  // (t.shape[0], dim1, *spatial)
    Ints shape{t.size(0), dim1};
    shape.insert(shape.end(), spatial.begin(), spatial.end());
    return shape;
}

// _fused.group_squares: (sq, safe), sq (N, groups, *S) the squares of x summed over each group's
// channels; safe is false where some sample's sum exceeds the dtype's maximum or is NaN.
std::pair<Tensor, bool> group_squares(const Tensor& x, int64_t groups) {
    Tensor sq = at::empty(with_spatial(x, groups, x.sizes().slice(2)), x.options());
    int64_t unsafe = AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "group_squares", [&] {
        auto pass = passes<scalar_t>().group_squares[layout_index(x)];
        return pass(x.data_ptr<scalar_t>(), x.size(0), x.size(1), spatial_size(x), groups,
                    std::numeric_limits<scalar_t>::max(), sq.data_ptr<scalar_t>(), at::get_num_threads());
    });
    return {sq, unsafe == 0};
}

// _fused.box (1/√(box sum + 1) of source over each receptive field, into (N, groups, *out_spatial))
// and, with `transpose`, _fused.box_transpose (source spread over them, into (N, groups, *in_spatial));
// the geometry is that of _fused._geometry.
Tensor box(const Tensor& source, at::IntArrayRef in_spatial, at::IntArrayRef out_spatial, at::IntArrayRef kernel,
           const Ints& stride, const Ints& padding, const Ints& dilation, bool transpose) {
    Tensor out =
        at::empty(with_spatial(source, source.size(1), transpose ? in_spatial : out_spatial), source.options());
    int64_t geometry[12];
    for (int d = 0; d < 2; ++d) {
        for (auto [field, value] : {std::pair{0, in_spatial[d]}, {1, out_spatial[d]}, {2, kernel[d]}, {3, stride[d]},
                                    {4, padding[d]}, {5, dilation[d]}}) {
            geometry[2 * field + d] = value;
        }
    }
    AT_DISPATCH_FLOATING_TYPES(source.scalar_type(), "box", [&] {
        passes<scalar_t>().box(source.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(), source.size(0) * source.size(1),
                               geometry, transpose ? 1 : 0, at::get_num_threads());
    });
    return out;
}

// _fused.channels_last_view: a contiguous (N, C, H, W) buffer's storage as a channels_last tensor.
Tensor channels_last_view(const Tensor& buffer) {
    return buffer.view({buffer.size(0), buffer.size(2), buffer.size(3), buffer.size(1)}).permute({0, 3, 1, 2});
}

// _fused.scale_and_dot: gy = r·gz per group (in gz's layout, or written channels_last with
// `to_channels_last`, gz then contiguous), e = −r²·Σ_{o∈g} gz_o·z_o if `with_dot`. With r and z
// undefined and `to_channels_last`: _fused.channels_last_copy of gz into `into`.
std::pair<Tensor, Tensor> scale_and_dot(const Tensor& gz, const Tensor& z, const Tensor& r, int64_t groups,
                                        bool with_dot, bool to_channels_last, const Tensor& into = Tensor()) {
    Tensor e = with_dot ? at::empty_like(r) : Tensor();
    Tensor gy = to_channels_last ? channels_last_view(into.defined() ? into : at::empty_like(gz)) : at::empty_like(gz);
    AT_DISPATCH_FLOATING_TYPES(gz.scalar_type(), "scale_and_dot", [&] {
        auto pass = to_channels_last ? passes<scalar_t>().scale_and_dot_to_cl
                                     : passes<scalar_t>().scale_and_dot[layout_index(gz)];
        pass(gz.data_ptr<scalar_t>(), ptr_or_null<scalar_t>(z), ptr_or_null<scalar_t>(r), gz.size(0), gz.size(1),
             spatial_size(gz), groups, gy.data_ptr<scalar_t>(), e.defined() ? e.data_ptr<scalar_t>() : nullptr,
             at::get_num_threads());
    });
    return {gy, e};
}

// _fused.channels_last_copy: t (N, C, H, W) contiguous, copied channels_last into the contiguous
// buffer `into`; returns the channels_last view of `into`.
Tensor channels_last_copy(const Tensor& t, const Tensor& into) {
    return scale_and_dot(t, Tensor(), Tensor(), 1, /*with_dot=*/false, /*to_channels_last=*/true, into).first;
}

// _fused.group_update_: t·r, or t + src·r, in place on t (r per group and position).
Tensor group_update_(const Tensor& t, const Tensor& r, int64_t groups, const Tensor& src = Tensor()) {
    AT_DISPATCH_FLOATING_TYPES(t.scalar_type(), "group_update", [&] {
        passes<scalar_t>().group_update[layout_index(t)](t.data_ptr<scalar_t>(), ptr_or_null<scalar_t>(src),
                                               r.data_ptr<scalar_t>(), t.size(0), t.size(1), spatial_size(r), groups,
                                               at::get_num_threads());
    });
    return t;
}

// _fused.group_update_from_channels_last: out = d + src·r, d channels_last, src and out contiguous.
Tensor group_update_from_channels_last(const Tensor& d, const Tensor& r, int64_t groups, const Tensor& src,
                                       const Tensor& out) {
    AT_DISPATCH_FLOATING_TYPES(d.scalar_type(), "group_update_from_cl", [&] {
        passes<scalar_t>().group_update_from_cl(d.data_ptr<scalar_t>(), src.data_ptr<scalar_t>(),
                                                r.data_ptr<scalar_t>(), d.size(0), d.size(1), spatial_size(r), groups,
                                                out.data_ptr<scalar_t>(), at::get_num_threads());
    });
    return out;
}

// _autograd._by_group: t (N, C, *S) viewed as (N, groups, C/groups, *S).
Tensor by_group(const Tensor& t, int64_t groups) {
    Ints shape{t.size(0), groups, t.size(1) / groups};
    shape.insert(shape.end(), t.sizes().begin() + 2, t.sizes().end());
    return t.view(shape);
}

// _autograd._channels_last_backward: whether the backward convolution of this contiguous 4-D
// float32 input runs channels_last (oneDNN's, as torch.compile runs it).
bool channels_last_backward(const Tensor& x, at::MemoryFormat layout) {
    return layout == at::MemoryFormat::Contiguous && x.dim() == 4 && x.scalar_type() == at::kFloat
           && passes_usable({x}) && at::globalContext().userEnabledMkldnn() && at::hasMKLDNN();
}

class PatchNormConvFunction : public torch::autograd::Function<PatchNormConvFunction> {
public:
    // (z, r) of PatchNormConvFunction.forward where its squares are safe (c = 1): sq those squares.
    static variable_list forward(AutogradContext* ctx, const Tensor& x, const Tensor& weight,
                                 const std::optional<Tensor>& bias, const Tensor& sq, Ints stride, Ints padding,
                                 Ints dilation, int64_t groups, bool hold) {
        Tensor y = at::convolution(x, weight, bias, stride, padding, dilation, false, {0, 0}, groups);
        Tensor r = box(sq, x.sizes().slice(2), y.sizes().slice(2), weight.sizes().slice(2), stride, padding, dilation,
                       false);
        if (passes_usable({y}, layout_of(y))) {
            group_update_(y, r, groups);
        } else {  // (_autograd._per_group in place)
            by_group(y, groups).mul_(r.unsqueeze(2));
        }
        ctx->save_for_backward({x, weight, r, bias.value_or(Tensor())});
        if (hold) {  // held, as the Python Function holds it: a detached alias and its version
            ctx->saved_data["z"] = y.detach();
            ctx->saved_data["z_version"] = static_cast<int64_t>(y._version());
        }
        ctx->saved_data["stride"] = stride;
        ctx->saved_data["padding"] = padding;
        ctx->saved_data["dilation"] = dilation;
        ctx->saved_data["groups"] = groups;
        ctx->set_materialize_grads(false);
        return {y, r};
    }

    static variable_list backward(AutogradContext* ctx, variable_list grads) {
        auto saved = ctx->get_saved_variables();
        const Tensor &x = saved[0], &weight = saved[1], &r = saved[2], &bias = saved[3];
        const Ints stride = ctx->saved_data["stride"].toIntVector(), padding = ctx->saved_data["padding"].toIntVector(),
                   dilation = ctx->saved_data["dilation"].toIntVector();
        const int64_t groups = ctx->saved_data["groups"].toInt();
        Tensor held;  // released at the first backward, as the Python Function's
        if (ctx->saved_data.count("z")) {
            held = ctx->saved_data["z"].toTensor();
            if (held._version() != ctx->saved_data["z_version"].toInt() || at::GradMode::is_enabled()) {
                held = Tensor();  // changed in place, or a graph being built: z is computed again
            }
            ctx->saved_data.erase("z");
            ctx->saved_data.erase("z_version");
        }
        const bool need_x = ctx->needs_input_grad(0), need_w = ctx->needs_input_grad(1);
        const bool need_b = bias.defined() && ctx->needs_input_grad(2);
        Tensor grad_z = grads[0];
        const Tensor& grad_r = grads[1];
        const Tensor z = need_x ? held : Tensor();  // (z is needed for dx only)
        bool fused = grad_z.defined() && !grad_r.defined() && (z.defined() || !need_x) && passes_usable({r});
        at::MemoryFormat layout = at::MemoryFormat::Contiguous;
        if (fused) {
            layout = layout_of(z.defined() ? z : grad_z);
            grad_z = grad_z.contiguous(layout);
            fused = passes_usable({grad_z, z}, layout);
        }
        if (!fused) {
            return python_grads(x, weight, r, bias, z, grads[0], grad_r, stride, padding, dilation, groups, need_x,
                                need_w, need_b);
        }
        Tensor gy, e, dx_buffer, x_conv = x;
        if ((need_x || need_w) && channels_last_backward(x, layout)) {  // gy and x transposed in the passes
            std::tie(gy, e) = scale_and_dot(grad_z, z, r, groups, need_x, /*to_channels_last=*/true);
            dx_buffer = at::empty_like(x);
            x_conv = need_w ? channels_last_copy(x, dx_buffer) : channels_last_view(dx_buffer);
        } else {
            std::tie(gy, e) = scale_and_dot(grad_z, z, r, groups, need_x, /*to_channels_last=*/false);
        }
        const at::OptionalIntArrayRef bias_sizes =
            bias.defined() ? at::OptionalIntArrayRef(bias.sizes()) : std::nullopt;
        auto [dx, dw, db] = at::convolution_backward(gy, x_conv, weight, bias_sizes, stride, padding, dilation, false,
                                                     {0, 0}, groups, {need_x, need_w, need_b});
        if (dx_buffer.defined() && dw.defined()) {  // (oneDNN returns it channels_last)
            dw = dw.contiguous(layout_of(weight));
        }
        if (need_x) {
            Tensor dsq2 = box(e, x.sizes().slice(2), e.sizes().slice(2), weight.sizes().slice(2), stride, padding,
                              dilation, true);
            if (dx_buffer.defined()) {  // dx = dx_cl + x·dsq2, back in x's layout
                dx = group_update_from_channels_last(dx.contiguous(at::MemoryFormat::ChannelsLast), dsq2, groups, x,
                                                     dx_buffer);
            } else if (passes_usable({dx, x}, layout_of(dx)) && passes_usable({dsq2})) {
                dx = group_update_(dx, dsq2, groups, x);
            } else {
                by_group(dx, groups).addcmul_(by_group(x, groups), dsq2.unsqueeze(2));
            }
        }
        return {dx, dw, db, Tensor(), Tensor(), Tensor(), Tensor(), Tensor(), Tensor()};
    }

private:
    // The Python Function's backward (_autograd.patchnorm_conv_grads) for what the fused branch does not take.
    static variable_list python_grads(const Tensor& x, const Tensor& weight, const Tensor& r, const Tensor& bias,
                                      const Tensor& z, const Tensor& grad_z, const Tensor& grad_r, const Ints& stride,
                                      const Ints& padding, const Ints& dilation, int64_t groups, bool need_x,
                                      bool need_w, bool need_b) {
        pybind11::gil_scoped_acquire gil;
        auto none_if_undefined = [](const Tensor& t) { return t.defined() ? pybind11::cast(t) : pybind11::none(); };
        auto grads = pybind11::module_::import("affdiv.layers._autograd").attr("patchnorm_conv_grads")(
            x, weight, r, none_if_undefined(bias), none_if_undefined(z), none_if_undefined(grad_z),
            none_if_undefined(grad_r), pybind11::make_tuple(stride, padding, dilation, groups),
            pybind11::make_tuple(need_x, need_w, need_b));
        variable_list out;
        for (auto grad : grads) {
            out.push_back(grad.is_none() ? Tensor() : grad.cast<Tensor>());
        }
        out.resize(9);
        return out;
    }
};

// Whether the nodes serve a call on these tensors: x of `dims` dimensions, all of x's dtype
// (float32/float64), on the CPU and plain; and not under torch.jit.trace, which records a C++ node's
// ops (not the passes) where it keeps a Python Function as one call. (The Python side has checked
// the rest of the state: no dynamo trace, torch.func transform, dispatch mode or forward-mode AD.)
bool servable(const Tensor& x, const Tensor& weight, const std::optional<Tensor>& bias, int64_t dims) {
    const auto dtype = x.scalar_type();
    if (torch::jit::tracer::isTracing() || x.dim() != dims || (dtype != at::kFloat && dtype != at::kDouble)) {
        return false;
    }
    for (const Tensor* t : {&x, &weight, bias.has_value() ? &*bias : &x}) {
        if (!(t->scalar_type() == dtype && t->is_cpu() && plain(*t))) {
            return false;
        }
    }
    return true;
}

std::optional<Tensor> affine_like(const Tensor& x, const Tensor& weight, const std::optional<Tensor>& bias) {
    if (!servable(x, weight, bias, 2)) {
        return std::nullopt;
    }
    return AffineLikeFunction::apply(x, weight, bias)[0];
}

std::optional<Tensor> norm_like(const Tensor& x, const Tensor& weight, const std::optional<Tensor>& bias, double k,
                                double eps) {
    if (!servable(x, weight, bias, 2)) {
        return std::nullopt;
    }
    return NormLikeFunction::apply(x, weight, bias, k, eps)[0];
}

// The node takes a call where PatchNormConvFunction.forward takes its fused branch: x's passes may
// run (x contiguous in its layout) and its squares sum finitely; those are passed to the node.
std::optional<Tensor> patchnorm_conv(const Tensor& x, const Tensor& weight, const std::optional<Tensor>& bias,
                                     Ints stride, Ints padding, Ints dilation, int64_t groups) {
    if (!servable(x, weight, bias, 4)) {
        return std::nullopt;
    }
    // (functional.patchnorm_conv2d has checked these with messages of its own; the passes below take
    // raw pointers, so a direct call is held to them too)
    TORCH_CHECK(weight.dim() == 4 && groups >= 1 && x.size(1) == weight.size(1) * groups
                    && weight.size(0) % groups == 0,
                "patchnorm_conv: weight (C_out, C_in/groups, kh, kw) with groups dividing C_out, got weight of shape ",
                weight.sizes(), ", input of shape ", x.sizes(), " and groups=", groups);
    TORCH_CHECK(stride.size() == 2 && padding.size() == 2 && dilation.size() == 2,
                "patchnorm_conv: stride, padding and dilation of two ints each");
    Tensor sq;
    {
        at::NoGradGuard no_grad;  // (as inside the node's forward, where the Function takes its squares)
        if (!passes_usable({x}, layout_of(x))) {
            return std::nullopt;
        }
        bool safe;
        std::tie(sq, safe) = group_squares(x, groups);
        if (!safe) {
            return std::nullopt;
        }
    }
    // z is held for backward only where the node joins a graph (an inference tensor has no version)
    const bool hold = at::GradMode::is_enabled() && x.requires_grad() && !c10::InferenceMode::is_enabled();
    return PatchNormConvFunction::apply(x, weight, bias, sq, stride, padding, dilation, groups, hold)[0];
}

// ------------------------------------------------------------------------------------------
// oneDNN's batched matrix product (for the stacked training engine, experiments/runs/stacked_matmul.py).
// torch multiplies float32 matrices with its BLAS; torch's own call of oneDNN's matmul,
// at::native::mkldnn_matmul (which torch uses in its reduced-precision matmul modes), is exported by
// libtorch_cpu but not declared in the headers torch installs: it is bound here by its symbol, from
// the library that holds at::globalContext, at the first call. The mangled name encodes the
// parameter types only, and the function has preconditions of its own (on x86 its float32 path
// needs AVX-512 or AVX-NE-CONVERT): so it is kept only if a small product through it, with beta 0
// and 1, runs and matches at::bmm; else null, and the engine multiplies with torch's ops.

using OnednnMatmul = void(const Tensor&, const Tensor&, const Tensor&, float, float);

// Whether `matmul` computes out = beta·out + alpha·(a b) on a (2, 3, 5) @ (2, 5, 4) product, with
// its first operand transposed, for beta = 0 and 1 (within float32 rounding of these sums).
bool passes_self_test(OnednnMatmul* matmul) {
    try {
        at::NoGradGuard no_grad;
        const auto options = at::TensorOptions().dtype(at::kFloat);
        const Tensor a = at::arange(30, options).reshape({2, 5, 3}).transpose(1, 2).div(7);
        const Tensor b = at::arange(40, options).reshape({2, 5, 4}).sub(9).div(5);
        const Tensor c = at::arange(24, options).reshape({2, 3, 4}).div(3);
        const Tensor product = at::bmm(a, b);
        Tensor out = at::empty({2, 3, 4}, options);
        matmul(a, b, out, 0.0f, 1.0f);
        bool ok = at::allclose(out, product, 1e-5, 1e-5);
        out.copy_(c);
        matmul(a, b, out, 1.0f, -0.5f);
        return ok && at::allclose(out, c - 0.5 * product, 1e-5, 1e-5);
    } catch (...) {
        return false;
    }
}

OnednnMatmul* onednn_matmul_symbol() {
    static OnednnMatmul* const symbol = []() -> OnednnMatmul* {
        Dl_info info;
        if (!at::hasMKLDNN() || dladdr(reinterpret_cast<void*>(&at::globalContext), &info) == 0) {
            return nullptr;
        }
        void* lib = dlopen(info.dli_fname, RTLD_NOW | RTLD_NOLOAD);
        auto* matmul = lib == nullptr ? nullptr
                                      : reinterpret_cast<OnednnMatmul*>(
                                            dlsym(lib, "_ZN2at6native13mkldnn_matmulERKNS_6TensorES3_S3_ff"));
        return matmul != nullptr && passes_self_test(matmul) ? matmul : nullptr;
    }();
    return symbol;
}

bool onednn_bound() {
    return onednn_matmul_symbol() != nullptr;
}

// out = beta·out + alpha·(a b) for float32 CPU tensors a (K, M, L), b (K, L, N), out (K, M, N)
// contiguous and overlapping neither (a and b may be transposed in their last two dimensions:
// oneDNN reads them as they are; other layouts it copies first). out is written in place (its
// version bumped), except that alpha = 0 leaves it as it is (oneDNN's matmul returns at once).
void onednn_bmm_(const Tensor& out, const Tensor& a, const Tensor& b, double beta, double alpha) {
    OnednnMatmul* matmul = onednn_matmul_symbol();
    TORCH_CHECK(matmul != nullptr, "onednn_bmm_: this torch has no usable oneDNN matmul");
    TORCH_CHECK(a.dim() == 3 && b.dim() == 3 && out.dim() == 3 && a.size(0) == b.size(0) && a.size(0) == out.size(0)
                    && a.size(2) == b.size(1) && out.size(1) == a.size(1) && out.size(2) == b.size(2),
                "onednn_bmm_: expected a (K, M, L), b (K, L, N) and out (K, M, N), got ", a.sizes(), ", ", b.sizes(),
                " and ", out.sizes());
    for (const Tensor* t : {&out, &a, &b}) {
        TORCH_CHECK(t->scalar_type() == at::kFloat && t->is_cpu() && t->layout() == at::kStrided,
                    "onednn_bmm_: expected strided float32 CPU tensors");
    }
    TORCH_CHECK(out.is_contiguous(), "onednn_bmm_: out must be contiguous");
    at::assert_no_overlap(out, a);
    at::assert_no_overlap(out, b);
    matmul(a, b, out, static_cast<float>(beta), static_cast<float>(alpha));
    out.unsafeGetTensorImpl()->bump_version();
}

}  // namespace affdiv

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
    m.doc() = "The corrected layers' autograd nodes in C++, and oneDNN's batched matmul (see affdiv.layers._native).";
    // (the GIL released while they run, as torch releases it in its own ops)
    m.def("affine_like", &affdiv::affine_like, "z = (x Wᵀ + b)/√(‖x‖² + 1) per row of a 2-D x (None: not servable)",
          pybind11::call_guard<pybind11::gil_scoped_release>());
    m.def("norm_like", &affdiv::norm_like, "z = W·k x/max(‖x‖, eps) + b per row of a 2-D x (None: not servable)",
          pybind11::call_guard<pybind11::gil_scoped_release>());
    m.def("patchnorm_conv", &affdiv::patchnorm_conv,
          "z = r·(conv(x, W) + b), r = 1/√(‖P‖² + 1) per group and position, of a 4-D x (None: not servable)",
          pybind11::call_guard<pybind11::gil_scoped_release>());
    m.def("onednn_bound", &affdiv::onednn_bound, "whether this torch's oneDNN matmul is bound (and passed its self-test)");
    m.def("onednn_bmm_", &affdiv::onednn_bmm_, "out = beta·out + alpha·(a b), batched, by oneDNN (float32)",
          pybind11::call_guard<pybind11::gil_scoped_release>());
    m.def("passes_bound", &affdiv::passes_are_bound, "whether the fused passes are bound");
    m.def("bind_passes", &affdiv::bind_passes, "bind the fused passes of the loaded library at this path "
          "(an empty path unbinds them); returns whether they are bound");
    // the version of the module's interface with the Python side (_autograd.patchnorm_conv_grads'
    // signature, the functions here): affdiv.layers._native loads only the version it was written for
    m.attr("PYTHON_INTERFACE") = 2;
    // an extension only loads into the torch it was compiled against (affdiv.layers._native checks)
    m.attr("BUILT_FOR_TORCH") = pybind11::make_tuple(TORCH_VERSION_MAJOR, TORCH_VERSION_MINOR, TORCH_VERSION_PATCH);
}
