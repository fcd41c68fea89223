// The dense corrected layers' autograd nodes in C++, so that a call pays no Python autograd.Function.
//
//     affine_like(x, W, b)        (z, r)   z = r·(x Wᵀ + b),   r = 1/√(‖x‖² + 1) per row
//     norm_like(x, W, b, k, eps)  (z, q)   z = q·(x Wᵀ) + b,   q = k/max(‖x‖, eps) per row
//
// Each is AffineLikeFunction / NormLikeFunction of _autograd.py, branch for branch: the fused row
// passes of _fused_cpu.c around the GEMMs where they may run (bound by name from that library,
// which affdiv.layers._fused loaded; every tensor contiguous and plain, no graph being recorded,
// no dispatch mode, no tangent), else the plain-torch passes, the same ops in the same order. So
// the same numbers to the bit as the Python Functions, the same saved tensors (the scale is an
// output and is saved as one, so a double backward sees its dependence on x through grad_r /
// grad_q) and the same overflow-safe rescaling as _scale.prepare. The derivations are in those
// classes' docstrings. A node's backward computes the gradients its backward asks for (a Python
// Function's, those whose inputs required one at forward time): the same numbers. x is 2-D
// (rows, in), every tensor a float32/float64 CPU tensor of one dtype (`servable` checks it before
// a node runs). Forward-mode AD and the torch.func transforms stay with the Python Functions,
// which have jvp and vmap rules; the backward here is differentiable (create_graph records its
// plain-torch ops).
#include <torch/extension.h>
#include <torch/version.h>

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
// the fused row passes (their prototypes in _fused_cpu.h)

template <typename T>
struct RowPasses {
    int64_t (*scale_outputs)(T*, const T*, int64_t, int64_t, int64_t, int, double, double, double, double, const T*,
                             const T*, T*, int) = nullptr;
    int (*scale_grad)(const T*, const T*, int64_t, int64_t, T*, T*, int, const T*, T*, int) = nullptr;
    void (*minus_radial)(T*, const T*, int64_t, int64_t, const T*, double, double, const T*, int) = nullptr;
};
static_assert(std::is_same_v<decltype(RowPasses<float>::scale_outputs), decltype(&scale_outputs_f32)> &&
              std::is_same_v<decltype(RowPasses<float>::scale_grad), decltype(&scale_grad_f32)> &&
              std::is_same_v<decltype(RowPasses<float>::minus_radial), decltype(&minus_radial_f32)> &&
              std::is_same_v<decltype(RowPasses<double>::scale_outputs), decltype(&scale_outputs_f64)> &&
              std::is_same_v<decltype(RowPasses<double>::scale_grad), decltype(&scale_grad_f64)> &&
              std::is_same_v<decltype(RowPasses<double>::minus_radial), decltype(&minus_radial_f64)>,
              "the row passes' types must be those of _fused_cpu.h");

RowPasses<float> passes_f32;
RowPasses<double> passes_f64;
// The pointers are written once, by the first bind (at the module's import, before any node runs);
// later binds and unbinds (for tests) only set or clear the flag.
std::atomic<bool> passes_bound{false};

template <typename T>
RowPasses<T>& passes();
template <>
RowPasses<float>& passes<float>() { return passes_f32; }
template <>
RowPasses<double>& passes<double>() { return passes_f64; }

template <typename T>
bool bind_type(void* lib, const char* suffix) {
    RowPasses<T>& p = passes<T>();
    std::string s(suffix);
    p.scale_outputs = reinterpret_cast<decltype(p.scale_outputs)>(dlsym(lib, ("scale_outputs_" + s).c_str()));
    p.scale_grad = reinterpret_cast<decltype(p.scale_grad)>(dlsym(lib, ("scale_grad_" + s).c_str()));
    p.minus_radial = reinterpret_cast<decltype(p.minus_radial)>(dlsym(lib, ("minus_radial_" + s).c_str()));
    return p.scale_outputs && p.scale_grad && p.minus_radial;
}

// Bind the row passes of the library at `path`, which must already be loaded (its handle is not
// closed: the library stays for the process; the first path bound is the one used for good); an
// empty path unbinds them. Returns whether bound.
bool bind_row_passes(const std::string& path) {
    static bool found = false;  // (written by the first call, at import: no node runs yet)
    static bool looked = false;
    passes_bound = false;
    if (path.empty()) {
        return false;
    }
    if (!looked) {
        looked = true;
        void* lib = dlopen(path.c_str(), RTLD_NOW | RTLD_NOLOAD);
        found = lib != nullptr && bind_type<float>(lib, "f32") && bind_type<double>(lib, "f64");
    }
    passes_bound = found;
    return found;
}

bool row_passes_bound() {
    return passes_bound;
}

// A strided tensor with its own storage: not a Python subclass (FakeTensor, …), not wrapped by
// torch.func or the legacy vmap, and carrying no forward-mode tangent (which a raw kernel would drop).
bool plain(const Tensor& t) {
    static const c10::DispatchKeySet wrapped({c10::DispatchKey::Python, c10::DispatchKey::FuncTorchGradWrapper,
                                              c10::DispatchKey::FuncTorchBatched, c10::DispatchKey::Batched});
    return (t.key_set() & wrapped).empty() && t.layout() == at::kStrided && t.has_storage()
           && !t._fw_grad(/*level=*/0).defined();
}

// _fused.usable: the row passes may run on these tensors (undefined ones ignored; the first is x).
bool row_passes_usable(std::initializer_list<Tensor> tensors) {
    if (!passes_bound || at::GradMode::is_enabled() || c10::impl::TorchDispatchModeTLS::stack_len() > 0) {
        return false;
    }
    const auto dtype = tensors.begin()->scalar_type();
    for (const Tensor& t : tensors) {
        if (t.defined() && !(t.scalar_type() == dtype && t.is_cpu() && t.is_contiguous() && plain(t))) {
            return false;
        }
    }
    return true;
}

const void* data_or_null(const Tensor& t) {
    return t.defined() ? t.data_ptr() : nullptr;
}

// _fused.scale_outputs: s (rows, 1), z scaled in place; false where some row is unsafe (module docstring of
// _fused): then z and s must be discarded.
bool scale_outputs(const Tensor& z, const Tensor& x, int mode, double k, double eps, double small, const Tensor& pre,
                   const Tensor& post, const Tensor& s) {
    return AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "scale_outputs", [&] {
        return passes<scalar_t>().scale_outputs(
                   z.data_ptr<scalar_t>(), x.data_ptr<scalar_t>(), x.size(0), x.size(1), z.size(1), mode, k, eps,
                   small, std::numeric_limits<scalar_t>::max(), static_cast<const scalar_t*>(data_or_null(pre)),
                   static_cast<const scalar_t*>(data_or_null(post)), s.data_ptr<scalar_t>(), at::get_num_threads())
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
            static_cast<const scalar_t*>(data_or_null(v)), dot.defined() ? dot.data_ptr<scalar_t>() : nullptr,
            at::get_num_threads());
    });
    TORCH_CHECK(failed == 0, "scale_grad: could not allocate the column-sum partials (", g.size(1), " columns)");
    return {gy, colsum, dot};
}

// _fused.minus_radial_: u_i ← u_i − a_i·(⟨u_i, x_i⟩ + c_i)·x_i in place, a_i = (m·s_i)² where s_i < limit.
Tensor minus_radial_(const Tensor& u, const Tensor& x, const Tensor& s, double m, double limit, const Tensor& c) {
    AT_DISPATCH_FLOATING_TYPES(u.scalar_type(), "minus_radial", [&] {
        passes<scalar_t>().minus_radial(u.data_ptr<scalar_t>(), x.data_ptr<scalar_t>(), u.size(0), u.size(1),
                                        s.data_ptr<scalar_t>(), m, limit, static_cast<const scalar_t*>(data_or_null(c)),
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
    if (row_passes_usable({x, weight, bias})) {
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
        if (row_passes_usable({x, weight, bias, r, grad_z, grad_r})) {
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
    if (row_passes_usable({x, weight, bias})) {
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
        if (row_passes_usable({x, weight, q, grad_z, grad_q})) {
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

// Whether the nodes serve a call on these tensors: x 2-D, all of x's dtype (float32/float64), on the
// CPU and plain; and not under torch.jit.trace, which records a C++ node's ops (not the row passes)
// where it keeps a Python Function as one call. (The Python side has checked the rest of the state:
// no dynamo trace, torch.func transform, dispatch mode or forward-mode AD.)
bool servable(const Tensor& x, const Tensor& weight, const std::optional<Tensor>& bias) {
    const auto dtype = x.scalar_type();
    if (torch::jit::tracer::isTracing() || x.dim() != 2 || (dtype != at::kFloat && dtype != at::kDouble)) {
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
    if (!servable(x, weight, bias)) {
        return std::nullopt;
    }
    return AffineLikeFunction::apply(x, weight, bias)[0];
}

std::optional<Tensor> norm_like(const Tensor& x, const Tensor& weight, const std::optional<Tensor>& bias, double k,
                                double eps) {
    if (!servable(x, weight, bias)) {
        return std::nullopt;
    }
    return NormLikeFunction::apply(x, weight, bias, k, eps)[0];
}

}  // namespace affdiv

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
    m.doc() = "The dense corrected layers' autograd nodes in C++ (see affdiv.layers._native).";
    // (the GIL released while they run, as torch releases it in its own ops)
    m.def("affine_like", &affdiv::affine_like, "z = (x Wᵀ + b)/√(‖x‖² + 1) per row of a 2-D x (None: not servable)",
          pybind11::call_guard<pybind11::gil_scoped_release>());
    m.def("norm_like", &affdiv::norm_like, "z = W·k x/max(‖x‖, eps) + b per row of a 2-D x (None: not servable)",
          pybind11::call_guard<pybind11::gil_scoped_release>());
    m.def("row_passes_bound", &affdiv::row_passes_bound, "whether the fused row passes are bound");
    m.def("bind_row_passes", &affdiv::bind_row_passes, "bind the fused row passes of the loaded library at this path "
          "(an empty path unbinds them); returns whether they are bound");
    // an extension only loads into the torch it was compiled against (affdiv.layers._native checks)
    m.attr("BUILT_FOR_TORCH") = pybind11::make_tuple(TORCH_VERSION_MAJOR, TORCH_VERSION_MINOR, TORCH_VERSION_PATCH);
}
