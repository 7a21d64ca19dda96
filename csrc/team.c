/* team.c - helper threads for work too short for an OpenMP parallel
 * region.
 *
 * GNU OpenMP's fork and join around a decoding step of 32 heads took a
 * fifth of the step's own arithmetic. Here the caller posts a task by
 * bumping a counter that the helpers watch, runs its own share, and waits
 * for theirs on another counter: each side sees the other's write one
 * cache line transfer later, a ninth of OpenMP's fork and join
 * (docs/performance.md, the C code's choices).
 *
 * A helper spins for SPIN_NS after its last task (a decoding loop's next
 * step comes sooner), then sleeps on a condition variable, so an idle
 * process burns no core. Two pools spinning on two cores would take turns
 * on them: GNU OpenMP's threads spin for milliseconds after a region, and
 * a decoding step alternating with a softmax call took a hundred times
 * longer when each step woke the team. So the team serves only long runs
 * of decoding steps: a step runs on it when the RUN_BEFORE_TEAM calls
 * before it that used several threads were decoding steps too (they go to
 * OpenMP, whose threads are awake from the call before the run), and
 * every OpenMP region of more than one thread first sends the helpers to
 * sleep (attnx_omp_threads). Waking them costs the run's first step on
 * the team about what the next dozen steps on it save: with 16 steps on
 * OpenMP first, no run loses more than that once, and runs of up to 16
 * steps are what they were. One caller at a time: a second thread that finds
 * the team busy is told so and uses OpenMP instead. A process created by
 * fork() has no helpers, but it never asks for any (runtime.c: a forked
 * child runs on one thread).
 *
 * A task is cut into as many ranges as members, and member m takes range
 * m first, so that from one decoding step to the next a head's state stays
 * in one core's cache. A member that has finished takes any range nobody
 * has started: the caller never waits for a helper that the system has
 * not scheduled (on a machine busy with other work, a 2-thread step took
 * the median ten times the one-thread step, waiting out the helper's turn
 * for a core), only for a range a helper is running. A range is taken by
 * writing the task's generation into its slot, so a helper that looks late,
 * at a task already done, takes nothing.
 *
 * Under OpenMP's thread binding (OMP_PROC_BIND, OMP_PLACES) the calling
 * thread is bound to one place, and a thread it creates inherits that
 * mask: every helper would share the caller's core, each spinning while
 * the other works (a step a hundred times slower with
 * OMP_PROC_BIND=spread on two cores). So on Linux the helpers run on the
 * CPUs of OpenMP's places that the caller is kept off (helper_cpus). And
 * when caller and helpers would not each have a CPU of their own (a
 * process held to one CPU by taskset, asked for two threads), the team is
 * not used at all: one spinning while the other works made a step thirty
 * times slower than through OpenMP, whose threads back off. Helpers are named
 * "attnx-team" (top -H, py-spy, /proc/PID/task/TID/comm). */
#if defined(__linux__)
#define _GNU_SOURCE  /* sched_getaffinity, CPU_SET, pthread_setaffinity_np, pthread_setname_np */
#endif
#include "attnx.h"

#if defined(_WIN32) || defined(__STDC_NO_ATOMICS__)

int attnx_team_run(int members, attnx_team_task task, void *context)
{
    (void)members, (void)task, (void)context;
    return 0;
}

void attnx_team_rest(void) {}

#else

#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <time.h>
#if defined(__linux__)
#include <omp.h>
#include <sched.h>
#endif

#define TEAM_MAX 64
#define POSTED(generation, members) ((generation) << 8 | (unsigned long)(members))
#define POSTED_GENERATION(posted) ((posted) >> 8)
#define POSTED_MEMBERS(posted) ((int)((posted) & 0xff))
#define SPIN_NS 500000L
#define RUN_BEFORE_TEAM 16

/* the generation of the last task whose range r someone took, one cache
 * line each: members take their own ranges at once */
typedef struct {
    atomic_ulong generation;
    char pad[64 - sizeof(atomic_ulong)];
} range_slot;

static struct {
    atomic_flag busy;               /* held by the caller running a task */
    int helpers;                    /* started so far (members 1..helpers) */
    unsigned long born[TEAM_MAX];   /* `posted` when each helper was made */
    _Atomic(attnx_team_task) task;  /* the task: written before `posted` moves */
    _Atomic(void *) context;
    /* the task's generation (bumped once per task) and its team's size, the
     * caller included (its ranges), in one word: POSTED(generation,
     * members), so that a helper never reads one task's size with
     * another's generation */
    atomic_ulong posted;
    atomic_int ranges_left;         /* ranges of the task not yet finished */
    range_slot taken[TEAM_MAX];
    atomic_int sleepers;            /* helpers waiting on `wake` */
    atomic_int resting;             /* set: spinning helpers go to sleep now */
    atomic_int decoding;            /* the calls of several threads since the last that was
                                       not a decoding step (at most RUN_BEFORE_TEAM) */
#if defined(__linux__)
    int crowded;                    /* teams of this many or more have too few CPUs */
#endif
    pthread_mutex_t lock;
    pthread_cond_t wake;
} team = {.busy = ATOMIC_FLAG_INIT, .lock = PTHREAD_MUTEX_INITIALIZER,
          .wake = PTHREAD_COND_INITIALIZER};

static inline void cpu_relax(void)
{
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield");
#endif
}

static long elapsed_ns(const struct timespec *since)
{
    struct timespec now;
    clock_gettime(CLOCK_MONOTONIC, &now);
    return (now.tv_sec - since->tv_sec) * 1000000000L + (now.tv_nsec - since->tv_nsec);
}

/* the task posted after `seen` (its `posted` word): spinning first, then
 * asleep */
static unsigned long next_task(unsigned long seen)
{
    unsigned long posted;
    struct timespec start;
    clock_gettime(CLOCK_MONOTONIC, &start);
    for (unsigned spins = 1;; spins++) {
        posted = atomic_load_explicit(&team.posted, memory_order_acquire);
        if (posted != seen) return posted;
        cpu_relax();
        if (atomic_load_explicit(&team.resting, memory_order_relaxed)) break;
        if (spins % 1024 == 0 && elapsed_ns(&start) > SPIN_NS) break;
    }
    pthread_mutex_lock(&team.lock);
    /* sleepers before posted, the caller the other way round (both
     * sequentially consistent): one of the two sees the other's write */
    atomic_fetch_add(&team.sleepers, 1);
    while ((posted = atomic_load(&team.posted)) == seen)
        pthread_cond_wait(&team.wake, &team.lock);
    atomic_fetch_sub(&team.sleepers, 1);
    pthread_mutex_unlock(&team.lock);
    return posted;
}

#if defined(__linux__)
/* The CPUs of OpenMP's places that the calling thread may not run on,
 * into cpus (*bound: found any). OpenMP binds the initial thread to one
 * place, and a Python thread started by it inherits that mask, so the
 * caller's mask is read from the system, not from OpenMP. With no places
 * (no binding asked for), or a caller free to run on all of them, a
 * helper keeps the caller's mask: the process's own, or what the user
 * chose with taskset or os.sched_setaffinity. Returns 0 when the caller
 * and the helpers, `members` threads, would share CPUs. */
static int helper_cpus(int members, cpu_set_t *cpus, int *bound)
{
    cpu_set_t caller, usable;
    int places = omp_get_num_places();
    *bound = 0;
    CPU_ZERO(cpus);
    if (sched_getaffinity(0, sizeof caller, &caller) != 0) return 1;  /* cannot tell */
    for (int place = 0; place < places; place++) {
        int count = omp_get_place_num_procs(place);
        int *ids = count > 0 ? malloc((size_t)count * sizeof *ids) : NULL;
        if (!ids) continue;
        omp_get_place_proc_ids(place, ids);
        for (int i = 0; i < count; i++)
            if (ids[i] >= 0 && ids[i] < CPU_SETSIZE && !CPU_ISSET(ids[i], &caller)) {
                CPU_SET(ids[i], cpus);
                *bound = 1;
            }
        free(ids);
    }
    CPU_OR(&usable, &caller, cpus);
    return CPU_COUNT(&usable) >= members;
}
#endif

/* Range r of task `generation`, unless someone has taken it (or that task
 * is done: every range of a finished task has been taken) */
static int take_range(int range, unsigned long generation)
{
    unsigned long last = atomic_load_explicit(&team.taken[range].generation,
                                              memory_order_relaxed);
    return last < generation &&
           atomic_compare_exchange_strong(&team.taken[range].generation, &last, generation);
}

/* Member `member`'s part of task `generation` of `members` ranges: its own
 * range, then any range still untaken. A range taken here proves the task
 * is not done (a task is done only once every range has been taken), and
 * no task is posted before the last is done: so the task and context read
 * after the taking are this task's. */
static void run_ranges(int member, int members, unsigned long generation)
{
    for (int i = 0; i < members; i++) {
        int range = (member + i) % members;
        if (!take_range(range, generation)) continue;
        attnx_team_task task = atomic_load_explicit(&team.task, memory_order_relaxed);
        task(atomic_load_explicit(&team.context, memory_order_relaxed), member, range, members);
        atomic_fetch_sub_explicit(&team.ranges_left, 1, memory_order_release);
    }
}

static void *helper_main(void *arg)
{
    int member = (int)(intptr_t)arg;
    /* not `posted` now: the task it was made for may be posted already */
    unsigned long seen = team.born[member];
    for (;;) {
        seen = next_task(seen);
        int members = POSTED_MEMBERS(seen);
        if (member < members) run_ranges(member, members, POSTED_GENERATION(seen));
    }
    return NULL;
}

/* helpers 1..wanted running; 0, or -1 when a thread could not start or
 * the team would not fit the CPUs */
static int start_helpers(int wanted)
{
#if defined(__linux__)
    cpu_set_t cpus;
    int bound = 0;
    if (team.crowded && wanted + 1 >= team.crowded) return -1;
    if (team.helpers < wanted && !helper_cpus(wanted + 1, &cpus, &bound)) {
        team.crowded = wanted + 1;
        return -1;
    }
#endif
    while (team.helpers < wanted) {
        pthread_t thread;
        pthread_attr_t attr;
        if (pthread_attr_init(&attr) != 0) return -1;
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        team.born[team.helpers + 1] = atomic_load(&team.posted);
        int failed = pthread_create(&thread, &attr, helper_main, (void *)(intptr_t)(team.helpers + 1));
        pthread_attr_destroy(&attr);
        if (failed) return -1;
#if defined(__linux__)
        pthread_setname_np(thread, "attnx-team");
        /* a failure leaves the caller's mask: slower, never wrong */
        if (bound) (void)pthread_setaffinity_np(thread, sizeof cpus, &cpus);
#endif
        team.helpers++;
    }
    return 0;
}

int attnx_team_run(int members, attnx_team_task task, void *context)
{
    if (members < 2 || members > TEAM_MAX) return 0;
    /* a run's first steps go to OpenMP (see the top of this file) */
    if (atomic_load_explicit(&team.decoding, memory_order_relaxed) < RUN_BEFORE_TEAM) {
        atomic_fetch_add_explicit(&team.decoding, 1, memory_order_relaxed);
        return 0;
    }
    if (atomic_flag_test_and_set_explicit(&team.busy, memory_order_acquire)) return 0;
    if (start_helpers(members - 1) < 0) {
        atomic_flag_clear_explicit(&team.busy, memory_order_release);
        return 0;
    }
    atomic_store_explicit(&team.task, task, memory_order_relaxed);
    atomic_store_explicit(&team.context, context, memory_order_relaxed);
    atomic_store_explicit(&team.ranges_left, members, memory_order_relaxed);
    atomic_store_explicit(&team.resting, 0, memory_order_relaxed);
    /* one caller at a time (busy): nobody else moves `posted` */
    unsigned long generation = POSTED_GENERATION(atomic_load(&team.posted)) + 1;
    atomic_store(&team.posted, POSTED(generation, members));
    if (atomic_load(&team.sleepers)) {
        pthread_mutex_lock(&team.lock);
        pthread_cond_broadcast(&team.wake);
        pthread_mutex_unlock(&team.lock);
    }
    run_ranges(0, members, generation);
    while (atomic_load_explicit(&team.ranges_left, memory_order_acquire) > 0) cpu_relax();
    atomic_flag_clear_explicit(&team.busy, memory_order_release);
    return 1;
}

void attnx_team_rest(void)
{
    atomic_store_explicit(&team.decoding, 0, memory_order_relaxed);
    if (!atomic_load_explicit(&team.resting, memory_order_relaxed))
        atomic_store_explicit(&team.resting, 1, memory_order_relaxed);
}

#endif
