// Every inline-PTX wrapper of the kernels: memory ordering, loads and stores, barriers, thread-block
// clusters and SFU math. Kernel sources hold no asm of their own.
//
// Scopes: `.sys` orders against peers reached over NVLink/PCIe (P2P-mapped memory) and the host (mapped
// host memory); `.gpu` only within this GPU. Use acquire loads to read a flag that another agent set
// with a release store or release atomic; everything the writer stored before its release is then
// visible to loads after the acquire.
//
// Overloads share a name where only the operand type differs (ld_acquire_sys on int, uint32_t, int64_t,
// uint64_t, ...); different ordering, scope or caching gets a different name.
//
// All functions are __device__ __forceinline__ and live in namespace deepep_cupy, the root of every
// kernel family (deepep_cupy::<family>), so kernels call them without qualification. Requires sm_70+
// (L2::256B prefetch hints need sm_80+, which is the oldest architecture the package targets); the
// cluster helpers exist only when compiling for sm_90+.
#pragma once

#include "nvrtc_compat.cuh"

namespace deepep_cupy {

// ---- thread identity ---------------------------------------------------------------------------

// Every lane of a warp, for the __*_sync intrinsics.
constexpr unsigned kFullMask = 0xffffffffu;

__device__ __forceinline__ int lane_id() {
    int lane;
    asm volatile("mov.s32 %0, %%laneid;" : "=r"(lane));
    return lane;
}

// ---- time --------------------------------------------------------------------------------------

// Nanoseconds from the GPU's global timer (same clock on every SM; resolution about 1 us on older
// parts, tens of ns on Hopper). Used for timeouts, see timeout.cuh.
__device__ __forceinline__ uint64_t globaltimer() {
    uint64_t t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}

// ---- fences ------------------------------------------------------------------------------------

__device__ __forceinline__ void fence_acq_rel_sys() { asm volatile("fence.acq_rel.sys;" ::: "memory"); }
__device__ __forceinline__ void fence_acq_rel_gpu() { asm volatile("fence.acq_rel.gpu;" ::: "memory"); }

// ---- volatile / relaxed loads and stores (no ordering, but never cached stale in L1) ------------

__device__ __forceinline__ int ld_volatile(const int* p) {
    int v;
    asm volatile("ld.volatile.global.s32 %0, [%1];" : "=r"(v) : "l"(p));
    return v;
}
__device__ __forceinline__ int64_t ld_volatile(const int64_t* p) {
    int64_t v;
    asm volatile("ld.volatile.global.s64 %0, [%1];" : "=l"(v) : "l"(p));
    return v;
}
__device__ __forceinline__ uint32_t ld_volatile(const uint32_t* p) {
    uint32_t v;
    asm volatile("ld.volatile.global.u32 %0, [%1];" : "=r"(v) : "l"(p));
    return v;
}
__device__ __forceinline__ void st_volatile(int* p, int v) {
    asm volatile("st.volatile.global.s32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}
__device__ __forceinline__ int ld_relaxed_sys(const int* p) {
    int v;
    asm volatile("ld.relaxed.sys.global.s32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}
__device__ __forceinline__ uint32_t ld_relaxed_sys(const uint32_t* p) {
    uint32_t v;
    asm volatile("ld.relaxed.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}
__device__ __forceinline__ uint64_t ld_relaxed_sys(const uint64_t* p) {
    uint64_t v;
    asm volatile("ld.relaxed.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
    return v;
}
__device__ __forceinline__ void st_relaxed_sys(int* p, int v) {
    asm volatile("st.relaxed.sys.global.s32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}
__device__ __forceinline__ void st_relaxed_sys(uint32_t* p, uint32_t v) {
    asm volatile("st.relaxed.sys.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}
__device__ __forceinline__ void st_relaxed_sys(uint64_t* p, uint64_t v) {
    asm volatile("st.relaxed.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}
__device__ __forceinline__ void st_relaxed_gpu(uint32_t* p, uint32_t v) {
    asm volatile("st.relaxed.gpu.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

// ---- acquire loads -----------------------------------------------------------------------------

__device__ __forceinline__ int ld_acquire_sys(const int* p) {
    int v;
    asm volatile("ld.acquire.sys.global.s32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}
__device__ __forceinline__ uint32_t ld_acquire_sys(const uint32_t* p) {
    uint32_t v;
    asm volatile("ld.acquire.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}
__device__ __forceinline__ int64_t ld_acquire_sys(const int64_t* p) {
    int64_t v;
    asm volatile("ld.acquire.sys.global.s64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
    return v;
}
__device__ __forceinline__ uint64_t ld_acquire_sys(const uint64_t* p) {
    uint64_t v;
    asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
    return v;
}
__device__ __forceinline__ int ld_acquire_gpu(const int* p) {
    int v;
    asm volatile("ld.acquire.gpu.global.s32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}
__device__ __forceinline__ int64_t ld_acquire_gpu(const int64_t* p) {
    int64_t v;
    asm volatile("ld.acquire.gpu.global.s64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
    return v;
}

// ---- release stores ----------------------------------------------------------------------------

__device__ __forceinline__ void st_release_sys(int* p, int v) {
    asm volatile("st.release.sys.global.s32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}
__device__ __forceinline__ void st_release_sys(uint32_t* p, uint32_t v) {
    asm volatile("st.release.sys.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}
__device__ __forceinline__ void st_release_sys(int64_t* p, int64_t v) {
    asm volatile("st.release.sys.global.s64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}
__device__ __forceinline__ void st_release_sys(uint64_t* p, uint64_t v) {
    asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}
__device__ __forceinline__ void st_release_gpu(int* p, int v) {
    asm volatile("st.release.gpu.global.s32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}
__device__ __forceinline__ void st_release_gpu(uint32_t* p, uint32_t v) {
    asm volatile("st.release.gpu.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

// ---- atomics (return the old value) ------------------------------------------------------------

__device__ __forceinline__ int atomic_add_release_sys(int* p, int v) {
    int old;
    asm volatile("atom.add.release.sys.global.s32 %0, [%1], %2;" : "=r"(old) : "l"(p), "r"(v) : "memory");
    return old;
}
__device__ __forceinline__ int atomic_add_release_gpu(int* p, int v) {
    int old;
    asm volatile("atom.add.release.gpu.global.s32 %0, [%1], %2;" : "=r"(old) : "l"(p), "r"(v) : "memory");
    return old;
}
__device__ __forceinline__ int atomic_add_relaxed_sys(int* p, int v) {
    int old;
    asm volatile("atom.add.relaxed.sys.global.s32 %0, [%1], %2;" : "=r"(old) : "l"(p), "r"(v) : "memory");
    return old;
}
__device__ __forceinline__ int atomic_cas_acq_rel_sys(int* p, int expected, int desired) {
    int old;
    asm volatile("atom.cas.acq_rel.sys.global.b32 %0, [%1], %2, %3;"
                 : "=r"(old)
                 : "l"(p), "r"(expected), "r"(desired)
                 : "memory");
    return old;
}

// ---- 16-byte vector loads and stores -----------------------------------------------------------
// Addresses must be 16-byte aligned.

// Read-only path, no L1 allocation. Only for data that no one (this kernel, a peer, the host) writes
// while the kernel runs: the non-coherent cache may return stale values otherwise. Not volatile, so
// the compiler may batch or merge these loads like ordinary ones.
__device__ __forceinline__ int4 ld_nc_v4(const int4* p) {
    int4 v;
    asm("ld.global.nc.L1::no_allocate.L2::256B.v4.s32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "l"(p));
    return v;
}
// The same without the L2 prefetch hint, from any address (not only an int4*). Not volatile and without a
// memory clobber either, so the compiler may issue it early, ahead of unrelated stores.
__device__ __forceinline__ int4 ld_nc_v4_no_prefetch(const void* p) {
    int4 v;
    asm("ld.global.nc.L1::no_allocate.v4.s32 {%0, %1, %2, %3}, [%4];"
        : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
        : "l"(p));
    return v;
}
// 8 bytes on the same path (no L2 prefetch hint).
__device__ __forceinline__ uint2 ld_nc_v2(const void* p) {
    uint2 v;
    asm("ld.global.nc.L1::no_allocate.v2.u32 {%0, %1}, [%2];" : "=r"(v.x), "=r"(v.y) : "l"(p));
    return v;
}
// Coherent 16-byte load (data written by peers, read after an acquire).
__device__ __forceinline__ int4 ld_v4(const int4* p) {
    int4 v;
    asm volatile("ld.global.v4.s32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "l"(p)
                 : "memory");
    return v;
}
__device__ __forceinline__ int4 ld_volatile_v4(const int4* p) {
    int4 v;
    asm volatile("ld.volatile.global.v4.s32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "l"(p));
    return v;
}
__device__ __forceinline__ void st_v4(int4* p, const int4& v) {
    asm volatile("st.global.v4.s32 [%0], {%1, %2, %3, %4};" ::"l"(p), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w)
                 : "memory");
}
// Streaming store that does not allocate in L1 (remote or write-once buffers).
__device__ __forceinline__ void st_na_v4(int4* p, const int4& v) {
    asm volatile("st.global.L1::no_allocate.v4.s32 [%0], {%1, %2, %3, %4};" ::"l"(p), "r"(v.x), "r"(v.y),
                 "r"(v.z), "r"(v.w)
                 : "memory");
}


// Coherent 16-byte load that skips L1 and asks L2 for the whole 256-byte block around it (rows another
// agent wrote before a flag the caller has acquired, read once).
__device__ __forceinline__ int4 ld_na_v4(const int4* p) {
    int4 v;
    asm volatile("ld.global.L1::no_allocate.L2::256B.v4.s32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "l"(p));
    return v;
}

// L2-only loads (`ld.global.cg`) for data that peers write while the kernel runs: a copy cached in L1
// from an earlier use of the same address must never be returned.
__device__ __forceinline__ int4 ld_cg_v4(const void* p) {
    int4 v;
    asm volatile("ld.global.cg.v4.s32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "l"(p)
                 : "memory");
    return v;
}
__device__ __forceinline__ uint32_t ld_cg_u32(const void* p) {
    uint32_t v;
    asm volatile("ld.global.cg.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}
__device__ __forceinline__ int ld_cg_s32(const void* p) {
    int v;
    asm volatile("ld.global.cg.s32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}
__device__ __forceinline__ float ld_cg_f32(const void* p) {
    float v;
    asm volatile("ld.global.cg.f32 %0, [%1];" : "=f"(v) : "l"(p) : "memory");
    return v;
}
__device__ __forceinline__ uint64_t ld_cg_u64(const void* p) {
    uint64_t v;
    asm volatile("ld.global.cg.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
    return v;
}
__device__ __forceinline__ long long ld_cg_s64(const void* p) {
    long long v;
    asm volatile("ld.global.cg.s64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
    return v;
}

// Ask L2 for the line holding `p` (no register result, no ordering).
__device__ __forceinline__ void prefetch_l2(const void* p) {
    asm volatile("prefetch.global.L2 [%0];" ::"l"(p));
}

// ---- barriers ----------------------------------------------------------------------------------

// Barrier over `threads` threads of the block (a multiple of 32) on named barrier `id` (1..15; 0 is the
// one __syncthreads uses).
__device__ __forceinline__ void named_barrier_sync(int id, int threads) {
    asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(threads) : "memory");
}

// ---- thread-block clusters (sm_90+) ------------------------------------------------------------

#if __CUDA_ARCH__ >= 900
// This block's rank within its cluster.
__device__ __forceinline__ int cluster_ctarank() {
    uint32_t r;
    asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
    return static_cast<int>(r);
}

// Every thread of every block of the cluster: shared-memory writes before it (release) are visible to all
// blocks after it (acquire).
__device__ __forceinline__ void cluster_sync() {
    asm volatile("barrier.cluster.arrive.release.aligned;\n\tbarrier.cluster.wait.acquire.aligned;" ::: "memory");
}

// Block `block`'s copy of the shared word at `p` (this block's address of it), through distributed shared
// memory.
__device__ __forceinline__ int ld_shared_cluster(const int* p, int block) {
    const uint32_t local = static_cast<uint32_t>(__cvta_generic_to_shared(p));
    uint32_t remote;
    int v;
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(local), "r"(block));
    asm volatile("ld.shared::cluster.u32 %0, [%1];" : "=r"(v) : "r"(remote) : "memory");
    return v;
}
#endif

// ---- math --------------------------------------------------------------------------------------

// SFU approximations (about 2^-22 relative error), without .ftz: subnormal inputs are kept.
__device__ __forceinline__ float lg2_approx(float x) {
    float y;
    asm("lg2.approx.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}
__device__ __forceinline__ float ex2_approx(float x) {
    float y;
    asm("ex2.approx.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

}  // namespace deepep_cupy
