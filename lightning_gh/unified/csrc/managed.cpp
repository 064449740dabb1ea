// lightning_gh's managed-memory allocator shim: the allocation pair PyTorch's CUDAPluggableAllocator calls
// (lgh_managed_malloc / lgh_managed_free, over cudaMallocManaged with advice, population and the safety guard),
// plus advice, prefetch and pointer queries for ctypes. Built at first use by lightning_gh/unified/shim.py, which
// describes the interface; the guard's rule is lightning_gh/unified/guard.py's.
#include <cuda_runtime_api.h>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <mutex>
#include <sys/types.h>

#define LGH_API extern "C" __attribute__((visibility("default")))

namespace {

constexpr int kMaxDevices = 64;

// What the calling thread's allocations get. Set from Python (lgh_set_config) when a managed_memory() scope is
// entered: PyTorch's caching allocator calls the allocator on the thread that asked for the tensor.
struct Config {
  int prefer_host;                // 1: preferred location host memory, 0: the allocating GPU
  int accessed_by;                // 1: cudaMemAdviseSetAccessedBy the allocating GPU
  int allow_oversubscription;     // 1: lift the guard (honoured only where the GPU is coherent)
  unsigned long long headroom;    // GPU bytes the guard keeps free beyond the managed bytes
  int populate;                   // 1: prefetch new pages to the preferred location at once
};

// Why the calling thread's last allocation returned NULL.
// kind: 1 guard refused, 2 cudaMallocManaged failed, 3 advice/prefetch failed, 4 cudaMemGetInfo failed, 5 bad args
struct Refusal {
  long long request, free_bytes, total_bytes, live, headroom;
  int device, cuda_error, coherent, kind;
};

thread_local Config t_config = {1, 1, 0, 512ull << 20, 1};
thread_local Refusal t_refusal = {};
thread_local int t_has_refusal = 0;

// One guard check + allocation at a time: two threads must not both pass the guard on the same free bytes.
std::mutex g_mutex;
unsigned long long g_live[kMaxDevices] = {};
unsigned long long g_peak[kMaxDevices] = {};
unsigned long long g_allocs[kMaxDevices] = {};
unsigned long long g_frees[kMaxDevices] = {};
unsigned long long g_refusals[kMaxDevices] = {};
int g_coherent[kMaxDevices];
std::once_flag g_init;

void init_globals() { for (int i = 0; i < kMaxDevices; ++i) g_coherent[i] = -1; }

int coherent_of(int device) {
  std::call_once(g_init, init_globals);
  if (g_coherent[device] < 0) {
    int v = 0;
    if (cudaDeviceGetAttribute(&v, cudaDevAttrPageableMemoryAccessUsesHostPageTables, device) != cudaSuccess) {
      cudaGetLastError();
      v = 0;  // unknown counts as not coherent: the safe side
    }
    g_coherent[device] = v ? 1 : 0;
  }
  return g_coherent[device];
}

// location < 0: host; otherwise a device ordinal.
#if CUDART_VERSION >= 13000
cudaMemLocation make_location(int location) {
  cudaMemLocation loc;
  if (location < 0) { loc.type = cudaMemLocationTypeHost; loc.id = 0; }
  else { loc.type = cudaMemLocationTypeDevice; loc.id = location; }
  return loc;
}
cudaError_t do_advise(const void* p, size_t n, cudaMemoryAdvise a, int location) {
  return cudaMemAdvise(p, n, a, make_location(location));
}
cudaError_t do_prefetch(const void* p, size_t n, int location, cudaStream_t s) {
  return cudaMemPrefetchAsync(p, n, make_location(location), 0, s);
}
#else
cudaError_t do_advise(const void* p, size_t n, cudaMemoryAdvise a, int location) {
  return cudaMemAdvise(p, n, a, location < 0 ? cudaCpuDeviceId : location);
}
cudaError_t do_prefetch(const void* p, size_t n, int location, cudaStream_t s) {
  return cudaMemPrefetchAsync(p, n, location < 0 ? cudaCpuDeviceId : location, s);
}
#endif

void refuse(int kind, long long request, int device, cudaError_t err, size_t free_b, size_t total_b,
            unsigned long long live, unsigned long long headroom, int coherent) {
  t_refusal.request = request;
  t_refusal.free_bytes = (long long)free_b;
  t_refusal.total_bytes = (long long)total_b;
  t_refusal.live = (long long)live;
  t_refusal.headroom = (long long)headroom;
  t_refusal.device = device;
  t_refusal.cuda_error = (int)err;
  t_refusal.coherent = coherent;
  t_refusal.kind = kind;
  t_has_refusal = 1;
}

}  // namespace

// The guard (lightning_gh.unified.guard.guard_refuses computes the same). Overflow-safe.
LGH_API int lgh_guard_refuses(unsigned long long request, unsigned long long free_bytes, unsigned long long live,
                              unsigned long long headroom, int coherent, int allow_oversubscription) {
  if (allow_oversubscription && coherent) return 0;
  if (request > free_bytes) return 1;
  unsigned long long room = free_bytes - request;
  if (live > room) return 1;
  room -= live;
  return headroom > room ? 1 : 0;
}

LGH_API void* lgh_managed_malloc(ssize_t size, int device, cudaStream_t stream) {
  t_has_refusal = 0;
  if (size <= 0 || device < 0 || device >= kMaxDevices) {
    refuse(5, (long long)size, device, cudaErrorInvalidValue, 0, 0, 0, 0, 0);
    return nullptr;
  }
  int previous = -1;
  if (cudaGetDevice(&previous) != cudaSuccess) previous = -1;
  if (previous != device) cudaSetDevice(device);
  void* ptr = nullptr;
  {
    std::lock_guard<std::mutex> lock(g_mutex);
    const Config c = t_config;
    const int coherent = coherent_of(device);
    const unsigned long long live = g_live[device];
    size_t free_b = 0, total_b = 0;
    cudaError_t err = cudaMemGetInfo(&free_b, &total_b);
    if (err != cudaSuccess) {
      refuse(4, (long long)size, device, err, 0, 0, live, c.headroom, coherent);
    } else if (lgh_guard_refuses((unsigned long long)size, free_b, live, c.headroom, coherent,
                                 c.allow_oversubscription)) {
      // Refused before cudaMallocManaged: nothing was allocated.
      g_refusals[device] += 1;
      refuse(1, (long long)size, device, cudaSuccess, free_b, total_b, live, c.headroom, coherent);
    } else {
      err = cudaMallocManaged(&ptr, (size_t)size, cudaMemAttachGlobal);
      if (err != cudaSuccess) {
        ptr = nullptr;
        refuse(2, (long long)size, device, err, free_b, total_b, live, c.headroom, coherent);
      } else {
        const int where = c.prefer_host ? -1 : device;
        err = do_advise(ptr, (size_t)size, cudaMemAdviseSetPreferredLocation, where);
        if (err == cudaSuccess && c.accessed_by)
          err = do_advise(ptr, (size_t)size, cudaMemAdviseSetAccessedBy, device);
        if (err == cudaSuccess && c.populate) {
          // Touch nothing during a stream capture: a prefetch cannot be captured.
          cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
          if (cudaStreamIsCapturing(stream, &status) != cudaSuccess) { cudaGetLastError(); status = cudaStreamCaptureStatusNone; }
          if (status == cudaStreamCaptureStatusNone) err = do_prefetch(ptr, (size_t)size, where, stream);
        }
        if (err != cudaSuccess) {
          cudaFree(ptr);
          ptr = nullptr;
          refuse(3, (long long)size, device, err, free_b, total_b, live, c.headroom, coherent);
        } else {
          g_live[device] += (unsigned long long)size;
          if (g_live[device] > g_peak[device]) g_peak[device] = g_live[device];
          g_allocs[device] += 1;
        }
      }
    }
  }
  // PyTorch checks cudaGetLastError() before its next allocation: leave no error of ours behind.
  if (ptr == nullptr) cudaGetLastError();
  if (previous >= 0 && previous != device) cudaSetDevice(previous);
  return ptr;
}

LGH_API void lgh_managed_free(void* ptr, ssize_t size, int device, cudaStream_t stream) {
  (void)stream;
  if (ptr == nullptr) return;
  std::lock_guard<std::mutex> lock(g_mutex);
  // cudaFree synchronises the device, so no kernel still reads the pages given back. At interpreter exit the
  // runtime may already be gone; the error is dropped.
  if (cudaFree(ptr) != cudaSuccess) cudaGetLastError();
  if (device >= 0 && device < kMaxDevices) {
    const unsigned long long n = size > 0 ? (unsigned long long)size : 0ull;
    g_live[device] = g_live[device] > n ? g_live[device] - n : 0ull;
    g_frees[device] += 1;
  }
}

LGH_API void lgh_set_config(int prefer_host, int accessed_by, int allow_oversubscription,
                            unsigned long long headroom, int populate) {
  t_config.prefer_host = prefer_host ? 1 : 0;
  t_config.accessed_by = accessed_by ? 1 : 0;
  t_config.allow_oversubscription = allow_oversubscription ? 1 : 0;
  t_config.headroom = headroom;
  t_config.populate = populate ? 1 : 0;
}

LGH_API void lgh_get_config(long long* out) {
  out[0] = t_config.prefer_host;
  out[1] = t_config.accessed_by;
  out[2] = t_config.allow_oversubscription;
  out[3] = (long long)t_config.headroom;
  out[4] = t_config.populate;
}

LGH_API int lgh_last_refusal(long long* out) {
  out[0] = t_refusal.request; out[1] = t_refusal.free_bytes; out[2] = t_refusal.total_bytes;
  out[3] = t_refusal.live; out[4] = t_refusal.headroom; out[5] = t_refusal.device;
  out[6] = t_refusal.cuda_error; out[7] = t_refusal.coherent; out[8] = t_refusal.kind;
  return t_has_refusal;
}

LGH_API void lgh_clear_refusal(void) { t_has_refusal = 0; }

LGH_API int lgh_stats(int device, unsigned long long* out) {
  if (device < 0 || device >= kMaxDevices) return -1;
  std::lock_guard<std::mutex> lock(g_mutex);
  out[0] = g_live[device]; out[1] = g_peak[device]; out[2] = g_allocs[device];
  out[3] = g_frees[device]; out[4] = g_refusals[device];
  return 0;
}

LGH_API void lgh_reset_peak(int device) {
  if (device < 0 || device >= kMaxDevices) return;
  std::lock_guard<std::mutex> lock(g_mutex);
  g_peak[device] = g_live[device];
}

// advice: 0 set preferred location, 1 unset it, 2 set accessed-by, 3 unset it, 4 set read-mostly, 5 unset it.
LGH_API int lgh_advise(void* ptr, unsigned long long size, int advice, int location) {
  static const cudaMemoryAdvise table[6] = {
      cudaMemAdviseSetPreferredLocation, cudaMemAdviseUnsetPreferredLocation, cudaMemAdviseSetAccessedBy,
      cudaMemAdviseUnsetAccessedBy, cudaMemAdviseSetReadMostly, cudaMemAdviseUnsetReadMostly};
  if (advice < 0 || advice > 5) return (int)cudaErrorInvalidValue;
  cudaError_t err = do_advise(ptr, (size_t)size, table[advice], location);
  if (err != cudaSuccess) cudaGetLastError();
  return (int)err;
}

LGH_API int lgh_prefetch(void* ptr, unsigned long long size, int location, void* stream) {
  cudaError_t err = do_prefetch(ptr, (size_t)size, location, (cudaStream_t)stream);
  if (err != cudaSuccess) cudaGetLastError();
  return (int)err;
}

// kind: 0 unregistered host memory, 1 pinned host, 2 device, 3 managed.
LGH_API int lgh_pointer_kind(void* ptr, int* kind, int* device) {
  cudaPointerAttributes a;
  cudaError_t err = cudaPointerGetAttributes(&a, ptr);
  if (err != cudaSuccess) { cudaGetLastError(); return (int)err; }
  *kind = (int)a.type;
  *device = a.device;
  return 0;
}

// The preferred location (device ordinal, -1 host, -2 none or mixed) and the last prefetch location of a range.
LGH_API int lgh_range_locations(void* ptr, unsigned long long size, int* preferred, int* last_prefetch) {
  cudaError_t err = cudaMemRangeGetAttribute(preferred, sizeof(int), cudaMemRangeAttributePreferredLocation, ptr,
                                             (size_t)size);
  if (err == cudaSuccess)
    err = cudaMemRangeGetAttribute(last_prefetch, sizeof(int), cudaMemRangeAttributeLastPrefetchLocation, ptr,
                                   (size_t)size);
  if (err != cudaSuccess) cudaGetLastError();
  return (int)err;
}

LGH_API int lgh_runtime_version(int* compiled, int* runtime) {
  *compiled = CUDART_VERSION;
  cudaError_t err = cudaRuntimeGetVersion(runtime);
  if (err != cudaSuccess) cudaGetLastError();
  return (int)err;
}

LGH_API const char* lgh_error_string(int err) { return cudaGetErrorString((cudaError_t)err); }
