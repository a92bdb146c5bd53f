/*
 * cpu_runtime.c -- the bottom layer of the kernels' .so (cpu_runtime.h): ISA detection and the
 * thread pool that every kernel shares (cpu_gemv.c, cpu_qgemv*.c, cpu_attention.c, cpu_layer.c
 * through them), and the library's version and limits.  It uses no symbol of any other kernel
 * file: the kernels hand the pool a task (pg_parallel_for), never the other way round.
 *
 * ISA: CPUID + XGETBV pick the best tier the CPU and OS support (cpu_runtime.h); pg_set_isa_cap
 * caps it, so one machine can run and test every lower tier.
 *
 * Threads: one caller thread plus (nthreads - 1) persistent workers.  Work is handed out in
 * chunks through one atomic ticket, so a worker that is slow to wake (asleep, or sharing its
 * core with torch's own threads) costs nothing: the caller simply takes the remaining chunks.
 * Workers spin briefly after each job (decode issues a linear every few tens of microseconds),
 * then yield, then sleep on a futex.  One pool per process: on a 2-core machine two pools,
 * each with a worker spinning on the second core, would fight.
 */
#define _GNU_SOURCE
#include <stdint.h>
#include <stddef.h>
#include <stdlib.h>
#include <string.h>
#include <stdatomic.h>
#include <pthread.h>
#include <sched.h>
#include <time.h>
#include <unistd.h>
#ifdef __linux__
#include <sys/syscall.h>
#endif
#if defined(__aarch64__) && defined(__linux__)
#include <sys/auxv.h>
#ifndef HWCAP_ASIMDDP
#define HWCAP_ASIMDDP (1 << 20)  /* (older kernel headers): AT_HWCAP's FEAT_DotProd bit */
#endif
#endif

#include "cpu_runtime.h"

#if defined(__linux__)
#include <linux/futex.h>
#include <sys/syscall.h>
#define PG_HAVE_FUTEX 1
#endif

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#include <cpuid.h>
#define PG_X86 1
#endif

/* The library's version (kernels/cpu_linear.py checks it). */
#define PG_VERSION 5
#define PG_MAX_THREADS 16
/* Software prefetch distance of the read probe: the GEMV tiles' (cpu_gemv.c). */
#ifndef PG_PF_BYTES
#define PG_PF_BYTES 8192
#endif

/* A pool job: task(task_ctx, n0, n1) over items [0, N) in chunks of chunk_rows, after npre
 * items of pre(task_ctx, i, i + 1): chunks 0 .. npre - 1 are those, then the task's, so
 * nchunks = npre + ceil(N / chunk_rows) (pg_parallel_for_pre). */
typedef struct {
    pg_task_fn task;
    const void *task_ctx;
    int N;
    int chunk_rows;     /* items per chunk */
    int nchunks;
    pg_task_fn pre;     /* NULL: npre = 0 */
    int npre;
} job_t;

/* ------------------------------------------------------------------------- */
/* CPU feature detection                                                      */
/* ------------------------------------------------------------------------- */

static int g_isa = -1;      /* best ISA the CPU + OS support */
static int g_isa_cap = 99;  /* user cap (tests force lower paths) */
static int g_has_avx_vnni = -1;  /* the CPU has AVX-VNNI (VEX vpdpbusd) */
static int g_avx_vnni = -1;      /* pg_set_avx_vnni: 1 on, 0 off, -1 the default (pg_avx_vnni) */
static int g_intel = 0;          /* the CPU's vendor is Intel (pg_bf16_fma's and pg_one_stream's defaults) */
static int g_bf16_fma = -1;      /* pg_set_bf16_fma: 1 FMAs, 0 vdpbf16ps, -1 the default */
static int g_one_stream = -1;    /* pg_set_one_stream: 1 one weight stream, 0 several, -1 the default */
static int g_has_amx = 0;        /* the CPU and OS have AMX-BF16 (detect_amx) */
static _Atomic int g_amx_grant = -1;  /* Linux's tile-data permission: -1 not asked yet, 0 refused, 1 granted */
static int g_bf16_amx = -1;      /* pg_set_bf16_amx: 1 on, 0 off, -1 the default (on) */
static int g_has_neon_dot = 0;   /* aarch64 with the dot-product extension (detect_neon_dot) */
static int g_neon_dot = -1;      /* pg_set_neon_dot: 1 on, 0 off, -1 the default (on where it exists) */

static int detect_isa(void)
{
#ifdef PG_X86
    unsigned a, b, c, d;
    if (!__get_cpuid(1, &a, &b, &c, &d))
        return ISA_PORTABLE;
    const int fma = (c >> 12) & 1, f16c = (c >> 29) & 1;
    if (!(c & (1u << 27)))          /* OSXSAVE */
        return ISA_PORTABLE;
    /* XCR0: the OS must save SSE and AVX state (bits 1-2) for AVX2, and also opmask,
     * ZMM_Hi256 and Hi16_ZMM (bits 5-7) for AVX-512. */
    unsigned lo, hi;
    __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
    if ((lo & 0x6u) != 0x6u || __get_cpuid_max(0, NULL) < 7)
        return ISA_PORTABLE;
    __cpuid_count(7, 0, a, b, c, d);
    const int avx2 = (b >> 5) & 1;
    if (!(avx2 && fma && f16c))
        return ISA_PORTABLE;
    int f = (b >> 16) & 1, dq = (b >> 17) & 1, bw = (b >> 30) & 1, vl = (b >> 31) & 1;
    if (!(f && dq && bw && vl) || (lo & 0xe6u) != 0xe6u)
        return ISA_AVX2;
    const int vnni = (c >> 11) & 1;
    __cpuid_count(7, 1, a, b, c, d);
    if (((a >> 5) & 1) && vnni)     /* AVX512_BF16 (+ VNNI, which every such CPU has) */
        return ISA_AVX512_BF16;
    return vnni ? ISA_AVX512_VNNI : ISA_AVX512;
#else
    return ISA_PORTABLE;
#endif
}

/* Armv8.2's FEAT_DotProd (SDOT / UDOT), which cpu_qgemv_neon.c's int8 rows need, from the
 * kernel's hwcaps (Linux: the only aarch64 OS this library builds for). */
static int detect_neon_dot(void)
{
#if defined(__aarch64__) && defined(__linux__)
    return (getauxval(AT_HWCAP) & HWCAP_ASIMDDP) != 0;
#else
    return 0;
#endif
}

static int detect_avx_vnni(void)
{
#ifdef PG_X86
    unsigned a, b, c, d;
    if (g_isa < ISA_AVX2 || __get_cpuid_max(0, NULL) < 7)  /* g_isa: detected just before */
        return 0;
    __cpuid_count(7, 1, a, b, c, d);
    return (a >> 4) & 1;  /* CPUID.(7, 1):EAX[4] AVX-VNNI; AVX state is checked by detect_isa */
#else
    return 0;
#endif
}

static int detect_intel(void)
{
#ifdef PG_X86
    unsigned a, b, c, d;
    if (!__get_cpuid(0, &a, &b, &c, &d))
        return 0;
    return b == 0x756e6547u && d == 0x49656e69u && c == 0x6c65746eu;  /* "Genu" "ineI" "ntel" */
#else
    return 0;
#endif
}

/* AMX-BF16 and AMX-TILE (CPUID.(7, 0):EDX[22], [24]) and their state in XCR0 (bits 17-18). */
static int detect_amx(void)
{
#if defined(PG_X86) && PG_AMX && defined(__linux__)
    unsigned a, b, c, d;
    if (g_isa < ISA_AVX512_BF16 || __get_cpuid_max(0, NULL) < 0xd)
        return 0;
    __cpuid_count(7, 0, a, b, c, d);
    if (!((d >> 22) & 1) || !((d >> 24) & 1))
        return 0;
    unsigned lo, hi;
    __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
    return ((lo >> 17) & 3u) == 3u;
#else
    return 0;
#endif
}

/* Linux's permission for this process to use the tile data (arch_prctl ARCH_REQ_XCOMP_PERM, as
 * torch's oneDNN asks it), once; two threads asking at once both get the same answer. */
int pg_amx_granted(void)
{
    int g = atomic_load(&g_amx_grant);
#if defined(PG_X86) && PG_AMX && defined(__linux__)
    if (g < 0) {
        g = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XFEATURE_XTILEDATA */) == 0;
        atomic_store(&g_amx_grant, g);
    }
#endif
    return g > 0;
}

static int current_isa(void)
{
    if (g_isa < 0)
        g_isa = detect_isa();
    return g_isa < g_isa_cap ? g_isa : g_isa_cap;
}

/* ------------------------------------------------------------------------- */
/* Thread pool                                                                */
/* ------------------------------------------------------------------------- */

/* Hot shared words on their own cache lines: the ticket is hammered by every
 * claimant, the wake word only by sleepers. */
typedef struct {
    _Alignas(64) _Atomic uint64_t ticket;  /* generation | nchunks | next chunk, see TK_* */
    _Alignas(64) _Atomic int done_chunks;  /* chunks finished in the current generation */
    _Alignas(64) _Atomic uint32_t wake;    /* futex word: bumped on every post */
    _Atomic int sleepers;
    _Alignas(64) job_t job;                /* written only while no chunk is claimable */
} pool_t;

static pool_t g_pool;
static pthread_mutex_t g_call_lock = PTHREAD_MUTEX_INITIALIZER;
static int g_nthreads = 2;         /* caller + workers */
static int g_started = 0;          /* workers running */
static _Atomic int g_spin_us = 300;   /* busy-wait after a job before yielding: covers the
                                          gaps between the linears of a decode step */
static _Atomic int g_yield_us = 3000;  /* then sched_yield() this long before sleeping */
static _Atomic int g_quit = 0;
static _Atomic int g_live = 0;        /* workers that have not exited */

static inline void cpu_relax(void)
{
#ifdef PG_X86
    _mm_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield");
#endif
}

static inline uint64_t now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

/* The ticket packs (generation << 32) | (nchunks << 16) | next chunk.  Claiming a
 * chunk is a CAS on the whole word, and the bound comes from the ticket itself, so a
 * successful claim proves the generation is current and unfinished; the job struct is
 * rewritten only after a generation finishes, hence a worker's copy of it, taken after
 * it saw the generation, is valid whenever its claim succeeds. */
#define TK_GEN(t) ((uint32_t)((t) >> 32))
#define TK_NCH(t) ((int)(((t) >> 16) & 0xffffu))
#define TK_NEXT(t) ((int)((t) & 0xffffu))

/* Diagnostics (pg_stats): pooled calls, chunks run by workers, total chunks. */
static _Atomic uint64_t g_stat_calls, g_stat_worker_chunks, g_stat_chunks;

/* Items [n0, n1) of a job. */
static inline void run_chunk(const job_t *j, int n0, int n1)
{
    j->task(j->task_ctx, n0, n1);
}


static int work_chunks(uint32_t gen, const job_t *j)
{
    int ran = 0;
    uint64_t t = atomic_load_explicit(&g_pool.ticket, memory_order_acquire);
    for (;;) {
        if (TK_GEN(t) != gen || TK_NEXT(t) >= TK_NCH(t))
            return ran;
        if (!atomic_compare_exchange_weak_explicit(&g_pool.ticket, &t, t + 1,
                                                   memory_order_acq_rel, memory_order_acquire))
            continue;
        int c = TK_NEXT(t);
        if (c < j->npre) {
            j->pre(j->task_ctx, c, c + 1);
        } else {
            /* Every pre item done first.  Chunks are claimed in order, so the pre items were all
             * claimed before this one, by threads now running them: no task chunk can finish
             * before they do, so done_chunks reaches npre exactly when they have. */
            for (unsigned spins = 0;
                 j->npre && atomic_load_explicit(&g_pool.done_chunks, memory_order_acquire) < j->npre; spins++) {
                if (spins < 20000)
                    cpu_relax();
                else
                    sched_yield();  /* the thread holding one may share this core */
            }
            c -= j->npre;
            int n0 = c * j->chunk_rows;
            int n1 = n0 + j->chunk_rows < j->N ? n0 + j->chunk_rows : j->N;
            run_chunk(j, n0, n1);
        }
        ran++;
        atomic_fetch_add_explicit(&g_pool.done_chunks, 1, memory_order_release);
        t = atomic_load_explicit(&g_pool.ticket, memory_order_acquire);
    }
}

static void futex_wait_u32(_Atomic uint32_t *addr, uint32_t val)
{
#ifdef PG_HAVE_FUTEX
    syscall(SYS_futex, (uint32_t *)addr, FUTEX_WAIT_PRIVATE, val, NULL, NULL, 0);
#else
    (void)addr; (void)val;
    usleep(50);
#endif
}

static void futex_wake_all(_Atomic uint32_t *addr)
{
#ifdef PG_HAVE_FUTEX
    syscall(SYS_futex, (uint32_t *)addr, FUTEX_WAKE_PRIVATE, 0x7fffffff, NULL, NULL, 0);
#else
    (void)addr;
#endif
}

static void *worker_main(void *arg)
{
    (void)arg;
    uint32_t seen = atomic_load_explicit(&g_pool.wake, memory_order_acquire);
    for (;;) {
        /* Wait for a post: spin (cheapest wake-up), then yield (lets torch's threads
         * or anything else on this core run), then sleep on the futex. */
        uint64_t t0 = now_ns();
        uint64_t spin_ns = (uint64_t)atomic_load_explicit(&g_spin_us, memory_order_relaxed) * 1000u;
        uint64_t yield_ns = spin_ns + (uint64_t)atomic_load_explicit(&g_yield_us, memory_order_relaxed) * 1000u;
        uint32_t w;
        unsigned iter = 0;
        for (;;) {
            w = atomic_load_explicit(&g_pool.wake, memory_order_acquire);
            if (w != seen || atomic_load_explicit(&g_quit, memory_order_relaxed))
                break;
            if ((++iter & 63u) == 0) {
                uint64_t el = now_ns() - t0;
                if (el >= yield_ns) {
                    atomic_fetch_add(&g_pool.sleepers, 1);
                    /* futex_wait returns at once if the word already moved on. */
                    if (atomic_load(&g_pool.wake) == seen && !atomic_load(&g_quit))
                        futex_wait_u32(&g_pool.wake, seen);
                    atomic_fetch_sub(&g_pool.sleepers, 1);
                    t0 = now_ns();
                } else if (el >= spin_ns) {
                    sched_yield();
                }
            }
            cpu_relax();
        }
        if (atomic_load_explicit(&g_quit, memory_order_relaxed)) {
            atomic_fetch_sub(&g_live, 1);
            return NULL;
        }
        seen = w;
        uint64_t t = atomic_load_explicit(&g_pool.ticket, memory_order_acquire);
        if (TK_NEXT(t) >= TK_NCH(t))
            continue;          /* the caller already took every chunk */
        job_t j = g_pool.job;  /* validated by the ticket CAS in work_chunks */
        int ran = work_chunks(TK_GEN(t), &j);
        if (ran)
            atomic_fetch_add_explicit(&g_stat_worker_chunks, (uint64_t)ran, memory_order_relaxed);
    }
}

static int start_workers_locked(void)
{
    if (g_started)
        return 0;
    atomic_store(&g_quit, 0);
    for (int i = 0; i < g_nthreads - 1; i++) {
        pthread_t th;
        pthread_attr_t at;
        pthread_attr_init(&at);
        pthread_attr_setdetachstate(&at, PTHREAD_CREATE_DETACHED);
        pthread_attr_setstacksize(&at, 256 * 1024);
        atomic_fetch_add(&g_live, 1);
        int rc = pthread_create(&th, &at, worker_main, NULL);
        pthread_attr_destroy(&at);
        if (rc != 0) {
            atomic_fetch_sub(&g_live, 1);
            g_nthreads = i + 1;  /* run with what we have */
            break;
        }
    }
    g_started = 1;
    return 0;
}

/* A fork()ed child has no worker threads: forget them so the next call restarts them. */
static void atfork_child(void)
{
    pthread_mutex_init(&g_call_lock, NULL);
    g_started = 0;
    atomic_store(&g_pool.sleepers, 0);
    atomic_store(&g_live, 0);
}

__attribute__((constructor)) static void pg_init(void)
{
    pthread_atfork(NULL, NULL, atfork_child);
    long n = sysconf(_SC_NPROCESSORS_ONLN);
    cpu_set_t cs;
    if (sched_getaffinity(0, sizeof(cs), &cs) == 0)
        n = CPU_COUNT(&cs);
    /* A start value only: the Python loader sets the pool to the usable physical cores
     * (kernels/cpu_threads.py: SMT siblings once, the cgroup quota) right after loading. */
    g_nthreads = n >= 2 ? 2 : 1;
    g_isa = detect_isa();  /* once, before any thread reads them */
    g_has_avx_vnni = detect_avx_vnni();
    g_has_neon_dot = detect_neon_dot();
    g_intel = detect_intel();
    g_has_amx = detect_amx();
}

/* ------------------------------------------------------------------------- */
/* Public C API                                                               */
/* ------------------------------------------------------------------------- */

int pg_version(void) { return PG_VERSION; }
int pg_max_m(void) { return PG_MAX_M; }
int pg_isa(void) { return current_isa(); }

int pg_avx_vnni(void)
{
    if (!PQ_AVXVNNI || g_has_avx_vnni <= 0 || current_isa() != ISA_AVX2)
        return 0;  /* built without the instruction, a CPU without it, or not tier avx2 */
    return g_avx_vnni >= 0 ? g_avx_vnni : g_isa == ISA_AVX2;
}

/* Turn tier avx2's AVX-VNNI rows on (1) or off (0), or back to the default (-1); returns
 * pg_avx_vnni().  The same bits either way: only the speed differs (tests compare them). */
int pg_set_avx_vnni(int on)
{
    g_avx_vnni = on < 0 ? -1 : on != 0;
    return pg_avx_vnni();
}
int pg_neon_dot(void)
{
    return PG_NEON_DOT && g_has_neon_dot && g_neon_dot != 0 && current_isa() == ISA_PORTABLE;
}

/* Turn the aarch64 SDOT rows off (0) or back to the default (-1 or 1: on where the CPU has the
 * extension); returns pg_neon_dot().  Off, the int8 path gives way to the fp32 rows (other bits). */
int pg_set_neon_dot(int on)
{
    g_neon_dot = on < 0 ? -1 : on != 0;
    return pg_neon_dot();
}
int pg_bf16_fma(void)
{
    if (current_isa() < ISA_AVX512_BF16)
        return 0;
    return g_bf16_fma >= 0 ? g_bf16_fma : g_intel;
}

int pg_one_stream(void)
{
#ifdef PG_X86
    return g_one_stream >= 0 ? g_one_stream : !g_intel;
#else
    return g_one_stream > 0;  /* measured on x86 only: aarch64 keeps its plans unless asked */
#endif
}

/* The small-M rows on one weight stream (1) or several (0), or back to the default (-1); returns
 * pg_one_stream().  The same bits either way (tests compare them). */
int pg_set_one_stream(int on)
{
    g_one_stream = on < 0 ? -1 : on != 0;
    return pg_one_stream();
}

/* Tier avx512_bf16's vdpbf16ps products by two FMAs (1) or by the instruction (0), or back to
 * the default (-1); returns pg_bf16_fma().  The same bits either way (tests compare them). */
int pg_set_bf16_fma(int on)
{
    g_bf16_fma = on < 0 ? -1 : on != 0;
    return pg_bf16_fma();
}
int pg_bf16_amx(void)
{
    return current_isa() >= ISA_AVX512_BF16 && g_has_amx && g_bf16_amx != 0 && atomic_load(&g_amx_grant) != 0;
}

/* bf16 weights on AMX tiles (1) or not (0), or back to the default (-1, on); returns
 * pg_bf16_amx().  Other bits than the vdpbf16ps path's (cpu_gemv_amx.c). */
int pg_set_bf16_amx(int on)
{
    g_bf16_amx = on < 0 ? -1 : on != 0;
    return pg_bf16_amx();
}
int pg_num_threads(void) { return g_nthreads; }

/* Cap the ISA tier (cpu_runtime.h: 0 portable, 1 AVX2, 2 AVX-512, 3 + VNNI, 4 + BF16); returns the
 * tier now in use. */
int pg_set_isa_cap(int cap)
{
    g_isa_cap = cap;
    return current_isa();
}

void pg_set_spin_us(int spin_us, int yield_us)
{
    atomic_store(&g_spin_us, spin_us < 0 ? 0 : spin_us);
    atomic_store(&g_yield_us, yield_us < 0 ? 0 : yield_us);
}

/* out[0] = calls that used the pool, out[1] = chunks their workers ran, out[2] = all chunks.
 * out[1] / out[2] near (nthreads-1)/nthreads means the workers keep up. */
void pg_stats(uint64_t out[3])
{
    out[0] = atomic_load(&g_stat_calls);
    out[1] = atomic_load(&g_stat_worker_chunks);
    out[2] = atomic_load(&g_stat_chunks);
}


/* Change the team size.  Stops the current workers (they exit at their next wake). */
int pg_set_num_threads(int n)
{
    if (n < 1) n = 1;
    if (n > PG_MAX_THREADS) n = PG_MAX_THREADS;
    pthread_mutex_lock(&g_call_lock);
    if (g_started && n != g_nthreads) {
        atomic_store(&g_quit, 1);
        atomic_fetch_add(&g_pool.wake, 1);
        futex_wake_all(&g_pool.wake);
        /* Workers hold no state; wait until every one has seen the quit flag. */
        while (atomic_load(&g_live) > 0) {
            futex_wake_all(&g_pool.wake);
            sched_yield();
        }
        g_started = 0;
    }
    g_nthreads = n;
    pthread_mutex_unlock(&g_call_lock);
    return n;
}

/*
 * Run job j (N items in j->nchunks chunks of j->chunk_rows) on the pool: the caller takes
 * chunks too, then waits for the ones still in a worker's hands.  If another caller holds
 * the pool, j runs on this thread alone.
 */
static void pool_run(job_t *j)
{
    if (g_nthreads <= 1 || j->nchunks <= 1 || pthread_mutex_trylock(&g_call_lock) != 0) {
        if (j->npre)
            j->pre(j->task_ctx, 0, j->npre);
        run_chunk(j, 0, j->N);
        return;
    }
    if (!g_started)
        start_workers_locked();

    /* Publish: job first, then the ticket (new generation, chunk 0), then the wake word. */
    uint32_t gen = TK_GEN(atomic_load_explicit(&g_pool.ticket, memory_order_relaxed)) + 1u;
    g_pool.job = *j;
    atomic_store_explicit(&g_pool.done_chunks, 0, memory_order_relaxed);
    atomic_store_explicit(&g_pool.ticket, ((uint64_t)gen << 32) | ((uint64_t)j->nchunks << 16),
                          memory_order_release);
    atomic_fetch_add_explicit(&g_pool.wake, 1, memory_order_seq_cst);
    if (atomic_load_explicit(&g_pool.sleepers, memory_order_seq_cst) > 0)
        futex_wake_all(&g_pool.wake);

    atomic_fetch_add_explicit(&g_stat_calls, 1, memory_order_relaxed);
    atomic_fetch_add_explicit(&g_stat_chunks, (uint64_t)j->nchunks, memory_order_relaxed);
    work_chunks(gen, j);
    /* Wait for chunks still in a worker's hands.  Normally that is the tail of one chunk
     * (microseconds); if the worker was preempted mid-chunk (an oversubscribed core),
     * yield so that, should it share our core, it can finish. */
    for (unsigned spins = 0;
         atomic_load_explicit(&g_pool.done_chunks, memory_order_acquire) < j->nchunks; spins++) {
        if (spins < 20000)
            cpu_relax();
        else
            sched_yield();
    }
    pthread_mutex_unlock(&g_call_lock);
}

/*
 * The pool for other kernels of this .so: task(ctx, i0, i1) over items [0, n) in chunks of
 * `per_chunk` items (at least; raised so that there are at most 65535 chunks), returning
 * when all are done.  ctx must stay valid until then (it may live on the caller's stack).
 */
__attribute__((visibility("hidden")))
void pg_parallel_for_pre(pg_task_fn pre, int npre, pg_task_fn task, const void *ctx, int n, int per_chunk)
{
    if (!pre || npre < 0)
        npre = 0;
    if (npre > 256) {  /* more than a pool call takes: done here first, never skipped */
        pre(ctx, 0, npre);
        npre = 0;
    }
    if (n <= 0) {
        if (npre)
            pre(ctx, 0, npre);
        return;
    }
    if (per_chunk < 1)
        per_chunk = 1;
    if ((n + per_chunk - 1) / per_chunk > 0xffff - npre)
        per_chunk = (n + 0xfffe - npre) / (0xffff - npre);
    job_t j;
    memset(&j, 0, sizeof(j));
    j.task = task;
    j.task_ctx = ctx;
    j.N = n;
    j.chunk_rows = per_chunk;
    j.pre = npre ? pre : NULL;
    j.npre = npre;
    j.nchunks = npre + (n + per_chunk - 1) / per_chunk;
    pool_run(&j);
}

__attribute__((visibility("hidden")))
void pg_parallel_for(pg_task_fn task, const void *ctx, int n, int per_chunk)
{
    pg_parallel_for_pre(NULL, 0, task, ctx, n, per_chunk);
}

/* Streaming-read probe (latency_bench/gemv_bench.py): the XOR of the 64-bit words of
 * buf[0, bytes), read over the pool in 64 KB chunks with the kernels' software prefetch, so
 * that its GB/s is the read bandwidth the GEMV tiles can hope for on this machine.  XOR is
 * order-independent, so gcc vectorises the loop at whatever width the build allows. */
typedef struct {
    const uint64_t *p;
    size_t words;
    _Atomic uint64_t acc;
} probe_t;

#define PG_PROBE_WORDS 8192   /* 64 KB per pool item */

static void probe_task(const void *ctx, int i0, int i1)
{
    probe_t *pr = (probe_t *)ctx;
    uint64_t a[8] = {0};
    for (int c = i0; c < i1; c++) {
        size_t w0 = (size_t)c * PG_PROBE_WORDS;
        size_t w1 = w0 + PG_PROBE_WORDS < pr->words ? w0 + PG_PROBE_WORDS : pr->words;
        size_t w = w0;
        for (; w + 8 <= w1; w += 8) {
            __builtin_prefetch((const char *)(pr->p + w) + PG_PF_BYTES);
            for (int i = 0; i < 8; i++)
                a[i] ^= pr->p[w + i];
        }
        for (; w < w1; w++)
            a[0] ^= pr->p[w];
    }
    atomic_fetch_xor(&pr->acc, a[0] ^ a[1] ^ a[2] ^ a[3] ^ a[4] ^ a[5] ^ a[6] ^ a[7]);
}

/* This core's clock now, in GHz, as a chain of dependent integer adds measures it over about `us`
 * microseconds (one add a cycle on every x86 and Arm core this runs on), or 0 where the chain is not
 * written (another ISA).  For the benchmarks' headers: a shared host's vCPU was seen at 1.9-3.7 GHz
 * within one minute, which moves compute-bound steps (a verify's rows) more than memory-bound ones. */
double pg_clock_ghz(int us)
{
#if defined(PG_X86) || defined(__aarch64__)
    const uint64_t t0 = now_ns(), want = (uint64_t)(us > 0 ? us : 1) * 1000u;
    uint64_t adds = 0, t = t0, c = 0;
    do {
        for (int i = 0; i < 4096; i++)  /* 16 dependent adds a pass */
#ifdef PG_X86
            __asm__ volatile("add $1, %0\n\tadd $1, %0\n\tadd $1, %0\n\tadd $1, %0\n\t"
                             "add $1, %0\n\tadd $1, %0\n\tadd $1, %0\n\tadd $1, %0\n\t"
                             "add $1, %0\n\tadd $1, %0\n\tadd $1, %0\n\tadd $1, %0\n\t"
                             "add $1, %0\n\tadd $1, %0\n\tadd $1, %0\n\tadd $1, %0" : "+r"(c));
#else
            __asm__ volatile("add %0, %0, #1\n\tadd %0, %0, #1\n\tadd %0, %0, #1\n\tadd %0, %0, #1\n\t"
                             "add %0, %0, #1\n\tadd %0, %0, #1\n\tadd %0, %0, #1\n\tadd %0, %0, #1\n\t"
                             "add %0, %0, #1\n\tadd %0, %0, #1\n\tadd %0, %0, #1\n\tadd %0, %0, #1\n\t"
                             "add %0, %0, #1\n\tadd %0, %0, #1\n\tadd %0, %0, #1\n\tadd %0, %0, #1" : "+r"(c));
#endif
        adds += 4096 * 16;
        t = now_ns();
    } while (t - t0 < want);
    return c == adds ? (double)adds / (double)(t - t0) : 0.0;
#else
    (void)us;
    return 0.0;
#endif
}

/* This core's fp32 multiply-add rate now, in GFLOP/s: twelve independent chains of a = a * b + c
 * on 8-float vectors (FMAs where the build's target has them) for about `us` microseconds.  Unlike
 * pg_clock_ghz it also sees whatever else shares the core's vector pipes (a host's other
 * hyperthread), which the int8 and bf16 rows of a verify are bound by. */
typedef float pg_v8f __attribute__((vector_size(32)));
double pg_vector_gflops(int us)
{
    const uint64_t t0 = now_ns(), want = (uint64_t)(us > 0 ? us : 1) * 1000u;
    const pg_v8f b = {0.999f, 0.998f, 0.997f, 0.996f, 0.995f, 0.994f, 0.993f, 0.992f};
    const pg_v8f c = {0.001f, 0.002f, 0.003f, 0.004f, 0.005f, 0.006f, 0.007f, 0.008f};
    pg_v8f a[12];
    for (int k = 0; k < 12; k++)
        a[k] = c * (float)(k + 1);
    uint64_t ops = 0, t = t0;
    do {
        for (int i = 0; i < 1024; i++)
            for (int k = 0; k < 12; k++)  /* (a fixed point near 1: no overflow, no subnormals) */
                a[k] = a[k] * b + c;
        ops += 1024 * 12;
        t = now_ns();
    } while (t - t0 < want);
    float s = 0.f;
    for (int k = 0; k < 12; k++)
        for (int l = 0; l < 8; l++)
            s += a[k][l];
    return s == s ? (double)ops * 8 * 2 / (double)(t - t0) : 0.0;
}

uint64_t pg_read_probe(const void *buf, size_t bytes)
{
    probe_t pr;
    pr.p = (const uint64_t *)buf;
    pr.words = bytes / 8;
    atomic_init(&pr.acc, 0);
    size_t items = (pr.words + PG_PROBE_WORDS - 1) / PG_PROBE_WORDS;
    if (items > 0x7fffffff)
        return 0;
    pg_parallel_for(probe_task, &pr, (int)items, 4);
    return atomic_load(&pr.acc);
}
