/*
 * A small thread pool: the calling thread takes the first share of a job, the workers the
 * others (a job may hand its work out in chunks of its own instead: products.c, attention.c);
 * workers spin a while for the next job, then sleep. One job at a time.
 *
 * Why spin SPIN_NS (0.3 ms): a sleeping worker's wake-up through the condition variable took
 * 16-64 us on the 2-core VM, while a decode step leaves gaps of 5-25 us between its jobs (the
 * serial norms, limb splits and merges between a layer's products and attention). Spinning
 * 20,000 loads (~10 us) slept through ~29 of those gaps a Qwen3-0.6B token, each a late
 * share the caller waited for; 0.3 ms left ~3 a token (the Python between tokens), and the
 * token 0.6-0.8 ms faster (bench/RESULTS.md, "The pool's spin"). Past 20 us a spinning
 * worker yields its core between checks of the clock, so a thread of the runner's own (the
 * HTTP server's, MLX's) that wants it gets it (the same speed as spinning throughout,
 * measured); an idle runner's workers sleep after 0.3 ms, and at once when the BLAS is
 * called (pool_rest): its own threads then need the cores.
 */
#include "internal.h"

#include <pthread.h>
#include <sched.h>
#include <time.h>
#include <unistd.h>

enum {
    SPIN_NS = 300000,       /* then sleep */
    YIELD_AFTER_NS = 20000, /* then yield the core between checks of the clock */
    SPIN_CHECK = 1024,      /* loads between checks of the clock */
};

static long long now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (long long)t.tv_sec * 1000000000LL + t.tv_nsec;
}

/* --- a small pool: the calling thread takes the first share, workers the others --------- */

static int threads;  /* including the caller */
static pthread_t pool[MAX_THREADS];
static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t wake = PTHREAD_COND_INITIALIZER;
static atomic_uint generation;
static atomic_int pending, sleeping;
static atomic_int resting; /* pool_rest: spinning workers sleep now */

/* The job on the pool: task(task_arg, index, threads) runs once for every index. */
static task_fn task;
static const void *task_arg;

static void *worker(void *arg) {
    const int index = (int)(size_t)arg;
    unsigned seen = 0;
    for (;;) {
        unsigned spins = 0;
        long long since = 0;
        while (atomic_load_explicit(&generation, memory_order_acquire) == seen) {
            if (++spins % SPIN_CHECK) continue;
            const long long now = now_ns();
            if (!since) since = now;
            if (now - since < SPIN_NS && !atomic_load_explicit(&resting, memory_order_relaxed)) {
                if (now - since >= YIELD_AFTER_NS) sched_yield();
                continue;
            }
            pthread_mutex_lock(&lock);
            atomic_fetch_add(&sleeping, 1);
            while (atomic_load(&generation) == seen) pthread_cond_wait(&wake, &lock);
            atomic_fetch_sub(&sleeping, 1);
            pthread_mutex_unlock(&lock);
        }
        seen = atomic_load_explicit(&generation, memory_order_acquire);
        task(task_arg, index, threads);
        atomic_fetch_sub_explicit(&pending, 1, memory_order_release);
    }
    return NULL;
}

static pthread_mutex_t callers = PTHREAD_MUTEX_INITIALIZER;

/* A forked child has none of the parent's workers: it starts its own when it needs them. */
static void forked(void) {
    threads = 0;
    pthread_mutex_init(&callers, NULL);
    pthread_mutex_init(&lock, NULL);
    pthread_cond_init(&wake, NULL);
    atomic_store(&sleeping, 0);
}

static void start_pool(void) { /* under `callers` */
    const char *env = getenv("RUNNER_BLAS_THREADS");
    long n = env ? atol(env) : sysconf(_SC_NPROCESSORS_ONLN);
    threads = n < 1 ? 1 : n > MAX_THREADS ? MAX_THREADS : (int)n;
    for (int i = 1; i < threads; i++)
        if (pthread_create(&pool[i], NULL, worker, (void *)(size_t)i) != 0) {
            threads = i;
            break;
        }
    static int registered;
    if (!registered++) pthread_atfork(NULL, NULL, forked);
}

/* fn(arg, i, n) for every i in [0, n), n the pool's threads, the caller taking i = 0; one
 * job on the pool at a time. */
void parallel(task_fn fn, const void *arg) {
    pthread_mutex_lock(&callers);
    if (threads == 0) start_pool();
    if (threads == 1) {
        pthread_mutex_unlock(&callers);
        fn(arg, 0, 1);
        return;
    }
    task = fn;
    task_arg = arg;
    atomic_store_explicit(&resting, 0, memory_order_relaxed);
    atomic_store(&pending, threads - 1);
    atomic_fetch_add_explicit(&generation, 1, memory_order_release);
    if (atomic_load(&sleeping) > 0) {
        pthread_mutex_lock(&lock);
        pthread_cond_broadcast(&wake);
        pthread_mutex_unlock(&lock);
    }
    fn(arg, 0, threads);
    while (atomic_load_explicit(&pending, memory_order_acquire) > 0) sched_yield();
    pthread_mutex_unlock(&callers);
}

/* Spinning workers sleep at once (before a call into the BLAS, whose threads would share the
 * cores with them); the next job wakes them. */
void pool_rest(void) { atomic_store_explicit(&resting, 1, memory_order_relaxed); }

/* The pool's threads, including the caller (starting the pool if it has not started). */
int pool_threads(void) {
    pthread_mutex_lock(&callers);
    if (threads == 0) start_pool();
    const int n = threads;
    pthread_mutex_unlock(&callers);
    return n;
}
