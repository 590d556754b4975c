// flashcupy.torch's compiled autograd node (built by flashcupy/_torch_node.py with
// torch.utils.cpp_extension; the Python node runs where it cannot be built).
//
// A Program is a launch plan of flashcupy/_launch.py written out for C++: its kernels (CUfunction
// handles of the modules CuPy loaded), grids, block sizes, dynamic shared memory and argument layouts,
// the TMA map templates, and the temporaries a run takes from torch's caching allocator. Python makes
// one per call signature (``_launch._ForwardPlan.program`` / ``_BackwardPlan.program``); a run here
// fills in the addresses of the call's tensors, so a training step's forward and backward launch from
// C++ on torch's current stream, with no Python on the autograd engine's thread.
//
// The argument wiring is the plans' own: each launch lists, per kernel argument, a fixed value (bytes),
// an address (a slot of the run's value table) or a TMA map (a map template over a slot). The slots of
// a forward run are FWD_*, of a backward run BWD_*, in the order of the plans' ``run`` methods.

#include <torch/extension.h>

#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/core/impl/TorchDispatchModeTLS.h>
#include <ATen/PythonTorchFunctionTLS.h>

#include <dlfcn.h>

#include <array>
#include <cstring>
#include <mutex>
#include <stdexcept>
#include <thread>
#include <string>
#include <unordered_map>
#include <vector>

namespace py = pybind11;
using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

namespace flashcupy {

// ---- the driver entry points (libcuda is loaded: CuPy and torch run on it) ----------------------------

using CUfunc = void*;
using CUstrm = void*;
using LaunchFn = int (*)(CUfunc, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, CUstrm,
                         void**, void**);
using EncodeFn = int (*)(void*, int, unsigned, void*, const uint64_t*, const uint64_t*, const uint32_t*,
                         const uint32_t*, int, int, int, int);
using CaptureFn = int (*)(CUstrm, int*);
using AllocFn = int (*)(uint64_t*, size_t);
using MemsetFn = int (*)(uint64_t, unsigned char, size_t, CUstrm);
using GetContextFn = int (*)(void**);
using DeviceFn = int (*)(int*, int);
using RetainFn = int (*)(void**, int);
using SetContextFn = int (*)(void*);
using ErrorNameFn = int (*)(int, const char**);

struct Driver {
  LaunchFn launch = nullptr;
  EncodeFn encode = nullptr;
  CaptureFn capturing = nullptr;
  AllocFn alloc = nullptr;
  MemsetFn memset = nullptr;
  GetContextFn get_context = nullptr;
  DeviceFn device = nullptr;
  RetainFn retain_primary = nullptr;
  SetContextFn set_context = nullptr;
  ErrorNameFn error_name = nullptr;
  Driver() {
    void* lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    if (lib == nullptr) throw std::runtime_error("flashcupy: libcuda.so.1 cannot be opened");
    launch = reinterpret_cast<LaunchFn>(dlsym(lib, "cuLaunchKernel"));
    encode = reinterpret_cast<EncodeFn>(dlsym(lib, "cuTensorMapEncodeTiled"));
    capturing = reinterpret_cast<CaptureFn>(dlsym(lib, "cuStreamIsCapturing"));
    alloc = reinterpret_cast<AllocFn>(dlsym(lib, "cuMemAlloc_v2"));
    memset = reinterpret_cast<MemsetFn>(dlsym(lib, "cuMemsetD8Async"));
    get_context = reinterpret_cast<GetContextFn>(dlsym(lib, "cuCtxGetCurrent"));
    device = reinterpret_cast<DeviceFn>(dlsym(lib, "cuDeviceGet"));
    retain_primary = reinterpret_cast<RetainFn>(dlsym(lib, "cuDevicePrimaryCtxRetain"));
    set_context = reinterpret_cast<SetContextFn>(dlsym(lib, "cuCtxSetCurrent"));
    error_name = reinterpret_cast<ErrorNameFn>(dlsym(lib, "cuGetErrorName"));
    if (!launch || !encode || !capturing || !alloc || !memset || !get_context || !device || !retain_primary ||
        !set_context || !error_name) throw std::runtime_error("flashcupy: a driver entry point is missing");
  }
};

const Driver& driver() {
  static Driver d;
  return d;
}

// "what failed: CUDA_ERROR_NAME (code)"
std::runtime_error cuda_error(const std::string& what, int err) {
  const char* name = nullptr;
  if (driver().error_name(err, &name) != 0 || name == nullptr) name = "unknown error";
  return std::runtime_error("flashcupy: " + what + ": " + name + " (" + std::to_string(err) + ")");
}

constexpr int kMapBytes = 128;
constexpr size_t kMapsLimit = 64;  // the maps a template keeps, one per address seen (then it starts over)

// ---- a program: launches, map templates, temporaries -------------------------------------------------

enum ArgKind { kFixed = 0, kAddress = 1, kMap = 2 };

struct Arg {
  int kind;
  int index;          // kAddress: the value slot; kMap: the map template
  std::string bytes;  // kFixed: the argument's bytes
};

struct Launch {
  std::string name;  // the kernel's, for errors
  CUfunc fn;
  unsigned grid[3];
  unsigned threads;
  unsigned smem;
  std::vector<Arg> args;
};

struct alignas(64) MapBytes {
  unsigned char b[kMapBytes];
};

struct MapTemplate {
  int slot;  // the value whose address the map holds
  int dtype, interleave, swizzle, l2, oob;
  uint64_t dims[4];
  uint64_t strides[3];
  uint32_t box[4];
  std::unordered_map<uint64_t, MapBytes> maps;  // by address (at most kMapsLimit)

  const MapBytes& at(uint64_t ptr) {
    auto it = maps.find(ptr);
    if (it != maps.end()) return it->second;
    if (maps.size() >= kMapsLimit) maps.clear();
    MapBytes m;
    const uint32_t ones[4] = {1, 1, 1, 1};
    int err = driver().encode(m.b, dtype, 4, reinterpret_cast<void*>(ptr), dims, strides, box, ones, interleave,
                              swizzle, l2, oob);
    if (err != 0) throw cuda_error("cuTensorMapEncodeTiled failed", err);
    return maps.emplace(ptr, m).first->second;
  }
};

enum ForwardSlot { FWD_Q, FWD_K, FWD_V, FWD_O, FWD_LSE, FWD_COUNTER, FWD_SLOTS };
enum BackwardSlot { BWD_DO, BWD_Q, BWD_K, BWD_V, BWD_O, BWD_LSE, BWD_DLSE, BWD_DQ, BWD_DK, BWD_DV, BWD_DELTA,
                    BWD_DQ_ACCUM, BWD_SEM, BWD_SLOTS };

bool capturing(CUstrm stream) {
  int status = 0;
  int err = driver().capturing(stream, &status);
  if (err != 0) throw cuda_error("cuStreamIsCapturing failed", err);
  return status != 0;
}

// The dynamic scheduler's tile counter (two int32, zero between launches: the kernel's last CTA resets
// it), one per device and stream (and thread, for the per-thread default stream) as _launch._tile_counter
// keeps one. They come from the driver, outside
// torch's allocator: a counter made while torch.compile's CUDA graph trees warm up would otherwise sit
// in the graph's pool for good. Under capture, and past 64 streams, a call's own from torch's allocator
// (the graph's pool under capture), zeroed in the stream's order.
at::Tensor tile_counter(const at::Tensor& like, CUstrm stream, uint64_t* ptr) {
  static std::mutex mu;
  static std::unordered_map<std::string, uint64_t> counters;
  if (!capturing(stream)) {
    std::string key = std::to_string(like.get_device()) + ":" + std::to_string(reinterpret_cast<uint64_t>(stream));
    if (stream == reinterpret_cast<CUstrm>(0x2)) {  // the per-thread default stream: each thread's own
      key += ":" + std::to_string(std::hash<std::thread::id>()(std::this_thread::get_id()));
    }
    std::lock_guard<std::mutex> lock(mu);
    auto it = counters.find(key);
    if (it != counters.end()) {
      *ptr = it->second;
      return at::Tensor();
    }
    if (counters.size() < 64) {
      uint64_t p = 0;
      int err = driver().alloc(&p, 2 * sizeof(int32_t));
      if (err == 0) err = driver().memset(p, 0, 2 * sizeof(int32_t), stream);
      if (err != 0) throw cuda_error("a tile counter could not be made", err);
      counters.emplace(key, p);
      *ptr = p;
      return at::Tensor();
    }
  }
  at::Tensor t = at::zeros({2}, like.options().dtype(at::kInt));
  *ptr = reinterpret_cast<uint64_t>(t.data_ptr());
  return t;
}

struct Program : torch::CustomClassHolder {
  std::vector<Launch> launches;
  std::vector<MapTemplate> maps;
  bool forward = true;
  bool dynamic = false;              // forward: the dynamic scheduler's counter
  int64_t dq_floats = 0;             // backward: the fp32 dQ buffer's floats (atomic paths), then delta's
  int64_t delta_floats = 0;
  std::vector<int64_t> sem_shape;    // backward: the ordered path's counters (none: empty)
  int64_t bwd_knobs = -1;            // backward: the Python fallback's knobs (an index)
  int64_t id = 0;                    // in the registry (below)
  std::mutex mu;                     // the map caches: one run at a time

  void release_resources() override;  // the last strong reference gone: out of the registry

  void launch_all(CUstrm stream, const uint64_t* values) {
    std::lock_guard<std::mutex> lock(mu);
    std::vector<void*> params;
    for (const Launch& l : launches) {
      params.clear();
      for (const Arg& a : l.args) {
        if (a.kind == kFixed) params.push_back(const_cast<char*>(a.bytes.data()));
        else if (a.kind == kAddress) params.push_back(const_cast<uint64_t*>(values + a.index));
        else params.push_back(const_cast<unsigned char*>(maps[a.index].at(values[maps[a.index].slot]).b));
      }
      int err = driver().launch(l.fn, l.grid[0], l.grid[1], l.grid[2], l.threads, 1, 1, l.smem, stream,
                                params.data(), nullptr);
      if (err != 0) throw cuda_error("cuLaunchKernel of " + l.name + " failed", err);
    }
  }
};

using ProgramPtr = c10::intrusive_ptr<Program>;

// Programs by id, held weakly: a node's context keeps its backward program's id (an integer, which torch's
// compiled autograd can hash and swap, as it cannot an opaque capsule) and the fallback's knobs; Python's
// memo holds the programs. A backward whose program is gone (the memo started over) takes the fallback.
std::mutex registry_mu;
std::unordered_map<int64_t, c10::weak_intrusive_ptr<Program>> registry;
int64_t next_id = 1;

void Program::release_resources() {
  std::lock_guard<std::mutex> lock(registry_mu);
  registry.erase(id);  // drops the registry's weak reference: the program is deleted after this
}

ProgramPtr registered(int64_t id) {
  std::lock_guard<std::mutex> lock(registry_mu);
  auto it = registry.find(id);
  return it == registry.end() ? ProgramPtr() : it->second.lock();
}

uint64_t address(const at::Tensor& t) { return t.defined() ? reinterpret_cast<uint64_t>(t.data_ptr()) : 0; }

// Make the device's primary context current on this thread where none is (as _launch._bind_context
// does): the driver's launch needs one, and a thread whose CUDA work so far went through torch's caches
// may have none. The autograd engine's device threads are such threads: before the first runtime call
// on them, cuLaunchKernel fails with CUDA_ERROR_INVALID_CONTEXT. Call under a guard of the device.
void bind_context(int device) {
  void* ctx = nullptr;
  int err = driver().get_context(&ctx);
  if (err == 0 && ctx != nullptr) return;
  int dev = 0;
  if (err == 0) err = driver().device(&dev, device);
  if (err == 0) err = driver().retain_primary(&ctx, dev);
  if (err == 0) err = driver().set_context(ctx);
  if (err != 0) throw cuda_error("no CUDA context could be made current", err);
}

CUstrm current_stream(const at::Tensor& t) {
  return reinterpret_cast<CUstrm>(c10::cuda::getCurrentCUDAStream(t.get_device()).stream());
}

// (o, lse) of a forward program: o C-contiguous of q's shape and dtype, lse float32 (B, H, N).
std::vector<at::Tensor> run_forward(Program& p, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v) {
  c10::cuda::CUDAGuard guard(q.device());
  bind_context(q.get_device());
  at::Tensor o = at::empty(q.sizes(), q.options());
  at::Tensor lse = at::empty({q.size(0), q.size(1), q.size(2)}, q.options().dtype(at::kFloat));
  CUstrm stream = current_stream(q);
  uint64_t values[FWD_SLOTS] = {address(q), address(k), address(v), address(o), address(lse), 0};
  at::Tensor counter;
  if (p.dynamic) counter = tile_counter(q, stream, &values[FWD_COUNTER]);
  p.launch_all(stream, values);
  return {o, lse};
}

// (dq, dk, dv) of a backward program; dlse may be undefined.
std::vector<at::Tensor> run_backward(Program& p, const at::Tensor& d_o, const at::Tensor& q, const at::Tensor& k,
                                     const at::Tensor& v, const at::Tensor& o, const at::Tensor& lse,
                                     const at::Tensor& dlse) {
  c10::cuda::CUDAGuard guard(q.device());
  bind_context(q.get_device());
  at::Tensor dq = at::empty(q.sizes(), q.options());
  at::Tensor dk = at::empty(k.sizes(), k.options());
  at::Tensor dv = at::empty(v.sizes(), v.options());
  CUstrm stream = current_stream(q);
  // one fp32 temporary: the dQ buffer (atomic paths), then delta
  at::Tensor buffer = at::empty({p.dq_floats + p.delta_floats}, q.options().dtype(at::kFloat));
  at::Tensor sem;
  if (!p.sem_shape.empty()) sem = at::zeros(p.sem_shape, q.options().dtype(at::kInt));
  uint64_t base = address(buffer);
  uint64_t values[BWD_SLOTS] = {address(d_o), address(q), address(k), address(v), address(o), address(lse),
                                address(dlse), address(dq), address(dk), address(dv), base + 4 * p.dq_floats,
                                p.dq_floats ? base : 0, address(sem)};
  p.launch_all(stream, values);
  return {dq, dk, dv};
}

// ---- Python's side: programs, and the fallback for what the programs do not take ------------------------

py::object* fallback = nullptr;  // flashcupy.torch._node_fallback (set once, never freed)

ProgramPtr make_program(bool forward, py::list launches, py::list maps, bool dynamic, int64_t dq_floats,
                        int64_t delta_floats, std::vector<int64_t> sem_shape, int64_t bwd_knobs) {
  auto p = c10::make_intrusive<Program>();
  p->forward = forward;
  p->dynamic = dynamic;
  p->dq_floats = dq_floats;
  p->delta_floats = delta_floats;
  p->sem_shape = std::move(sem_shape);
  p->bwd_knobs = bwd_knobs;
  {
    std::lock_guard<std::mutex> lock(registry_mu);
    p->id = next_id++;
    registry.emplace(p->id, c10::weak_intrusive_ptr<Program>(p));
  }
  for (py::handle h : launches) {
    auto t = h.cast<py::tuple>();  // (fn, (gx, gy, gz), threads, smem, [(kind, index, bytes), ...], name)
    Launch l;
    l.fn = reinterpret_cast<CUfunc>(t[0].cast<uint64_t>());
    l.name = t[5].cast<std::string>();
    auto grid = t[1].cast<std::vector<unsigned>>();
    for (int i = 0; i < 3; ++i) l.grid[i] = grid.at(i);
    l.threads = t[2].cast<unsigned>();
    l.smem = t[3].cast<unsigned>();
    for (py::handle a : t[4].cast<py::list>()) {
      auto at = a.cast<py::tuple>();
      Arg arg{at[0].cast<int>(), at[1].cast<int>(), at[2].cast<std::string>()};
      int limit = arg.kind == kAddress ? (forward ? FWD_SLOTS : BWD_SLOTS) : static_cast<int>(py::len(maps));
      if (arg.kind != kFixed && (arg.index < 0 || arg.index >= limit))
        throw std::invalid_argument("flashcupy: a program argument's slot or map is out of range");
      l.args.push_back(std::move(arg));
    }
    p->launches.push_back(std::move(l));
  }
  for (py::handle h : maps) {
    // (slot, dtype, interleave, swizzle, l2, oob, dims[4], strides[3], box[4])
    auto t = h.cast<py::tuple>();
    MapTemplate m;
    m.slot = t[0].cast<int>();
    if (m.slot < 0 || m.slot >= (forward ? FWD_SLOTS : BWD_SLOTS))
      throw std::invalid_argument("flashcupy: a map template's slot is out of range");
    m.dtype = t[1].cast<int>();
    m.interleave = t[2].cast<int>();
    m.swizzle = t[3].cast<int>();
    m.l2 = t[4].cast<int>();
    m.oob = t[5].cast<int>();
    auto dims = t[6].cast<std::vector<uint64_t>>();
    auto strides = t[7].cast<std::vector<uint64_t>>();
    auto box = t[8].cast<std::vector<uint32_t>>();
    for (int i = 0; i < 4; ++i) m.dims[i] = dims.at(i), m.box[i] = box.at(i);
    for (int i = 0; i < 3; ++i) m.strides[i] = strides.at(i);
    p->maps.push_back(std::move(m));
  }
  return p;
}

// A gradient as a backward program reads it: C-contiguous (the strides it was made for: those of the
// node's own o and lse) and aligned (16 bytes: TMA and vector loads; lse rows 4); otherwise one copy, of
// the same values, so the same bits come out.
at::Tensor dense(const at::Tensor& t, uint64_t align) {
  if (t.is_contiguous()) return address(t) % align ? t.clone(at::MemoryFormat::Contiguous) : t;
  return t.contiguous();
}

struct AttentionNode : public torch::autograd::Function<AttentionNode> {
  // compiled autograd traces backward with its own dispatch modes active: the fallback then runs the
  // custom operator, which it can trace
  static constexpr bool is_traceable = true;

  static variable_list forward(AutogradContext* ctx, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                               const ProgramPtr& fwd, const ProgramPtr& bwd) {
    auto out = run_forward(*fwd, q, k, v);
    ctx->save_for_backward({q, k, v, out[0], out[1]});
    ctx->saved_data["bwd"] = bwd->id;
    ctx->saved_data["knobs"] = bwd->bwd_knobs;
    ctx->set_materialize_grads(false);
    return out;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const at::Tensor& d_o = grads[0];
    const at::Tensor& dlse = grads[1];
    variable_list none(5);
    if (!d_o.defined() && !dlse.defined()) return none;
    auto saved = ctx->get_saved_variables();
    ProgramPtr bwd = registered(ctx->saved_data["bwd"].toInt());
    variable_list out;
    // a torch dispatch or function mode entered around backward() (FlopCounterMode, ...) must see the
    // custom operator, which the Python code runs there
    bool modes =
        c10::impl::TorchDispatchModeTLS::stack_len() > 0 || at::impl::PythonTorchFunctionTLS::stack_len() > 0;
    if (bwd && !bwd->launches.empty() && !torch::GradMode::is_enabled() && !modes) {
      // autograd's gradient of o may have any strides (stride 0 from o.sum(), the transposed layout of
      // layout="bnhd"); a missing one (a loss of the LSE alone) is zeros
      at::Tensor g = d_o.defined() ? dense(d_o, 16) : at::zeros_like(saved[3]);
      out = run_backward(*bwd, g, saved[0], saved[1], saved[2], saved[3], saved[4],
                         dlse.defined() ? dense(dlse, 4) : dlse);
    } else {
      // a program without launches (the backward plan cannot read q, k, v in place, or the checks refuse)
      // or gone, create_graph=True, whose gradients must refuse a second differentiation, and modes: Python
      py::gil_scoped_acquire gil;
      auto as_obj = [](const at::Tensor& t) -> py::object { return t.defined() ? py::cast(t) : py::none(); };
      auto r = (*fallback)(ctx->saved_data["knobs"].toInt(), as_obj(d_o), as_obj(dlse), saved[0], saved[1], saved[2], saved[3],
                           saved[4]).cast<std::vector<at::Tensor>>();
      out = std::move(r);
    }
    out.resize(5);
    return out;
  }
};

}  // namespace flashcupy

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  using namespace flashcupy;
  py::class_<Program, ProgramPtr>(m, "Program")
      .def_property_readonly("launch_count", [](const Program& p) { return p.launches.size(); });
  m.def("program", &make_program, "A launch plan written out for C++ (_launch's ``program`` methods)",
        py::arg("forward"), py::arg("launches"), py::arg("maps"), py::arg("dynamic"), py::arg("dq_floats"),
        py::arg("delta_floats"), py::arg("sem_shape"), py::arg("bwd_knobs") = -1);
  m.def("set_fallback", [](py::object f) { fallback = new py::object(std::move(f)); });
  m.def("apply", [](const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const ProgramPtr& fwd,
                    const ProgramPtr& bwd) { return AttentionNode::apply(q, k, v, fwd, bwd); });
  m.def("forward", [](const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const ProgramPtr& fwd) {
    return run_forward(*fwd, q, k, v);
  });
}
