/*
 * A small thread pool: the calling thread takes the first share of a job, the workers the
 * others; workers spin a while for the next job, then sleep. One job at a time.
 */
#include "internal.h"

#include <pthread.h>
#include <sched.h>
#include <unistd.h>

enum { SPINS = 20000 };

/* --- a small pool: the calling thread takes the first share, workers the others --------- */

static int threads;  /* including the caller */
static pthread_t pool[MAX_THREADS];
static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t wake = PTHREAD_COND_INITIALIZER;
static atomic_uint generation;
static atomic_int pending, sleeping;

/* The job on the pool: task(task_arg, index, threads) runs once for every index. */
static task_fn task;
static const void *task_arg;

static void *worker(void *arg) {
    const int index = (int)(size_t)arg;
    unsigned seen = 0;
    for (;;) {
        int spins = 0;
        while (atomic_load_explicit(&generation, memory_order_acquire) == seen) {
            if (++spins < SPINS) continue;
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

/* The pool's threads, including the caller (starting the pool if it has not started). */
int pool_threads(void) {
    pthread_mutex_lock(&callers);
    if (threads == 0) start_pool();
    const int n = threads;
    pthread_mutex_unlock(&callers);
    return n;
}
