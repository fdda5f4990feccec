/* Copy-on-write for shared pieces in a trial's process (see coordinated_prep/pages.py).
 *
 * A shared piece lies in Ray's object store, a MAP_SHARED mapping of one file that every process on
 * the node maps. A trial must be able to write into its batches as into a DataLoader's, and the write
 * must reach no other process, nor this process's later readers of the same piece. So a held piece's
 * pages are mapped read-only here; the first write into them faults, and the handler below gives this
 * process a private copy of the piece's pages at the same addresses:
 *
 *   1. stash = a second mapping of the same shared pages (mremap with old_size 0), kept until release;
 *   2. scratch = private anonymous pages holding a copy of the piece's bytes;
 *   3. scratch is moved over the piece's addresses (mremap MREMAP_FIXED replaces the mapping at once:
 *      a reader on another thread sees the same bytes before and after, never a hole);
 *   4. the write runs again, now into private memory.
 *
 * Release (the trial's last view of the piece was collected, before Ray may reuse the memory) moves
 * the stash back over the piece's addresses, so they are the object store's pages again, and maps
 * them writable as Ray left them. A piece that was never written costs two mprotect calls. A small
 * piece that Ray inlined into this process's own memory is written in place instead (copy_out).
 *
 * Concurrency: hold/release run with the GIL held and take `table` (never taken in the handler). The
 * handler runs on any thread, also one of torch's without the GIL; a slot's `state` moves
 * SHARED -> COPYING -> PRIVATE by compare-and-swap, so one faulting thread copies and the others wait
 * for it (microseconds to milliseconds: one memcpy of the piece) and then run their write again. A
 * fault outside every held piece goes to the handler that was installed before (faulthandler's, or
 * the default action), as it would without this module.
 */
#define _GNU_SOURCE
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <pthread.h>
#include <errno.h>
#include <sched.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdint.h>
#include <string.h>
#include <sys/mman.h>

#define SLOTS 8192 /* pieces one process holds at once; past it, pages.py copies the piece instead */

enum { FREE = 0, FILLING, SHARED, COPYING, PRIVATE };

typedef struct {
    _Atomic int state;
    uintptr_t start;  /* page-aligned */
    size_t length;    /* a multiple of the page size */
    void *stash;      /* PRIVATE: the original bytes (the shared pages, mapped elsewhere) until release */
    int in_place;     /* PRIVATE: the piece's own pages were private already, and written where they are */
} slot_t;

static slot_t slots[SLOTS];
static pthread_mutex_t table = PTHREAD_MUTEX_INITIALIZER;
static struct sigaction previous;
static _Atomic long copies;

/* The first write into a held piece: keep its original bytes at `stash` and give this process
 * writable bytes of its own at the piece's addresses. */
static int copy_out(slot_t *s) {
    void *stash = mremap((void *)s->start, 0, s->length, MREMAP_MAYMOVE);
    if (stash == MAP_FAILED) {
        /* Not a shared mapping: a small object Ray keeps in this process's own memory (inlined, under
         * 100 KiB). Its pages are this process's already, so they become writable where they are, and
         * a copy of the original bytes goes back into them at release (a later reader of the object in
         * this process, such as the next pass over a resident evaluation piece, reads them again). */
        stash = mmap(NULL, s->length, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_POPULATE, -1, 0);
        if (stash == MAP_FAILED) return 0;
        memcpy(stash, (void *)s->start, s->length);
        if (mprotect((void *)s->start, s->length, PROT_READ | PROT_WRITE) != 0) {
            munmap(stash, s->length);
            return 0;
        }
        s->stash = stash;
        s->in_place = 1;
        return 1;
    }
    /* MAP_POPULATE: the pages are made at once, not one fault per page during the copy. */
    void *scratch = mmap(NULL, s->length, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_POPULATE, -1, 0);
    if (scratch == MAP_FAILED) {
        munmap(stash, s->length);
        return 0;
    }
    memcpy(scratch, (void *)s->start, s->length);
    if (mremap(scratch, s->length, s->length, MREMAP_MAYMOVE | MREMAP_FIXED, (void *)s->start) == MAP_FAILED) {
        munmap(scratch, s->length);
        munmap(stash, s->length);
        return 0;
    }
    s->stash = stash;
    s->in_place = 0;
    return 1;
}

static void chain(int sig, siginfo_t *info, void *context) {
    if (previous.sa_flags & SA_SIGINFO) {
        previous.sa_sigaction(sig, info, context);
    } else if (previous.sa_handler == SIG_DFL || previous.sa_handler == SIG_IGN) {
        signal(sig, SIG_DFL); /* the faulting instruction runs again and ends the process, as without us */
    } else {
        previous.sa_handler(sig);
    }
}

/* The first write into `s` (whose state this thread moved to COPYING): PRIVATE, or SHARED again. */
static int make_private(slot_t *s) {
    int ok = copy_out(s);
    atomic_store(&s->state, ok ? PRIVATE : SHARED);
    if (ok) atomic_fetch_add(&copies, 1);
    return ok;
}

static void on_fault(int sig, siginfo_t *info, void *context) {
    int saved = errno; /* the interrupted code's errno survives the calls made here */
    uintptr_t addr = (uintptr_t)info->si_addr;
    if (info->si_code == SEGV_ACCERR) {
        for (int i = 0; i < SLOTS; i++) {
            slot_t *s = &slots[i];
            /* start and length are read unsynchronised: a slot being refilled may show a torn range,
             * which the check after the compare-and-swap (or the next slot) sorts out. */
            if (atomic_load(&s->state) < SHARED || addr < s->start || addr - s->start >= s->length) continue;
            int expected = SHARED;
            if (atomic_compare_exchange_strong(&s->state, &expected, COPYING)) {
                if (addr < s->start || addr - s->start >= s->length) { /* refilled meanwhile: not ours */
                    atomic_store(&s->state, SHARED);
                    continue;
                }
                if (make_private(s)) {
                    errno = saved;
                    return;
                }
                break; /* no memory for a copy: the write fails as it would without us */
            }
            while (atomic_load(&s->state) == COPYING) sched_yield();
            if (atomic_load(&s->state) == PRIVATE && addr >= s->start && addr - s->start < s->length) {
                errno = saved;
                return;
            }
        }
    }
    errno = saved;
    chain(sig, info, context);
}

/* Ours on top of SIGSEGV, checked at every hold: a handler installed after ours (faulthandler.enable())
 * is put below ours at the next hold. Until then it sees a first write first and ends the process, so
 * crash handlers belong before the first piece (Ray's worker enables faulthandler at its start). */
static int ensure_handler(void) {
    struct sigaction now;
    if (sigaction(SIGSEGV, NULL, &now) != 0) return 0;
    if ((now.sa_flags & SA_SIGINFO) && now.sa_sigaction == on_fault) return 1;
    struct sigaction ours;
    memset(&ours, 0, sizeof ours);
    ours.sa_sigaction = on_fault;
    ours.sa_flags = SA_SIGINFO | SA_ONSTACK | SA_RESTART;
    sigemptyset(&ours.sa_mask);
    previous = now;
    return sigaction(SIGSEGV, &ours, NULL) == 0;
}

static slot_t *find(uintptr_t start, size_t length) {
    for (int i = 0; i < SLOTS; i++) {
        if (atomic_load(&slots[i].state) >= SHARED && slots[i].start == start && slots[i].length == length)
            return &slots[i];
    }
    return NULL;
}

/* hold(start, length) -> 0: held, its pages copy-on-write here until release(start, length);
 * 1: held already in this process (a second reader of one object: its writes must not reach the first
 * one's views, nor theirs its): copy its original bytes with original(); 2: it could not be held (no
 * slot left, mprotect refused) and nobody here writes into it: copy it as it is. */
static PyObject *hold(PyObject *self, PyObject *args) {
    unsigned long long start, length;
    if (!PyArg_ParseTuple(args, "KK", &start, &length)) return NULL;
    int result = 2;
    pthread_mutex_lock(&table);
    if (find(start, length) != NULL) {
        result = 1;
    } else if (ensure_handler()) {
        for (int i = 0; i < SLOTS; i++) {
            int expected = FREE;
            if (!atomic_compare_exchange_strong(&slots[i].state, &expected, FILLING)) continue;
            slots[i].start = start;
            slots[i].length = length;
            slots[i].stash = NULL;
            if (mprotect((void *)start, length, PROT_READ) != 0) {
                atomic_store(&slots[i].state, FREE);
                break;
            }
            atomic_store(&slots[i].state, SHARED);
            result = 0;
            break;
        }
    }
    pthread_mutex_unlock(&table);
    return PyLong_FromLong(result);
}

/* original(start, length, offset, out) -> True: `out` holds the held piece's original bytes from
 * `offset` on. The first reader's pages are made private first (if they were not), so that no write
 * of its threads, which run without the GIL, can reach the bytes copied here; the copy is made under
 * `table`, so no release moves the stash meanwhile. False: the piece is not held (any more). */
static PyObject *original(PyObject *self, PyObject *args) {
    unsigned long long start, length, offset;
    Py_buffer out;
    if (!PyArg_ParseTuple(args, "KKKw*", &start, &length, &offset, &out)) return NULL;
    int ok = 0;
    pthread_mutex_lock(&table);
    slot_t *s = find(start, length);
    if (s != NULL && offset + (unsigned long long)out.len <= length) {
        int expected = SHARED;
        while (!atomic_compare_exchange_strong(&s->state, &expected, COPYING)) {
            if (expected == PRIVATE) break;
            expected = SHARED; /* COPYING: a fault handler is copying it now */
            sched_yield();
        }
        if (expected == PRIVATE || make_private(s)) {
            memcpy(out.buf, (char *)s->stash + offset, (size_t)out.len);
            ok = 1;
        }
    }
    pthread_mutex_unlock(&table);
    PyBuffer_Release(&out);
    if (!ok && s != NULL) return PyErr_NoMemory(); /* held, but no memory to set its original bytes apart */
    return PyBool_FromLong(ok);
}

/* release(start, length) -> False if the pages could not be given back as Ray left them. */
static PyObject *release(PyObject *self, PyObject *args) {
    unsigned long long start, length;
    if (!PyArg_ParseTuple(args, "KK", &start, &length)) return NULL;
    int ok = 1;
    pthread_mutex_lock(&table);
    slot_t *s = find(start, length);
    if (s != NULL) {
        while (atomic_load(&s->state) == COPYING) sched_yield();
        int state = atomic_load(&s->state);
        if (state == PRIVATE && !s->in_place &&
            mremap(s->stash, length, length, MREMAP_MAYMOVE | MREMAP_FIXED, (void *)start) == MAP_FAILED) {
            ok = 0; /* the slot stays held: better a leak than this process reading its copy as Ray's bytes */
        } else {
            if (mprotect((void *)start, length, PROT_READ | PROT_WRITE) != 0) ok = 0;
            if (state == PRIVATE && s->in_place) {
                memcpy((void *)start, s->stash, length); /* the object's bytes as Ray gave them */
                munmap(s->stash, length);
            }
            atomic_store(&s->state, FREE);
        }
    }
    pthread_mutex_unlock(&table);
    return PyBool_FromLong(ok);
}

static PyObject *held(PyObject *self, PyObject *noargs) {
    long n = 0;
    for (int i = 0; i < SLOTS; i++) n += atomic_load(&slots[i].state) >= SHARED;
    return PyLong_FromLong(n);
}

static PyObject *copied(PyObject *self, PyObject *noargs) { return PyLong_FromLong(atomic_load(&copies)); }

static PyMethodDef methods[] = {
    {"hold", hold, METH_VARARGS, "Hold a piece's pages copy-on-write: 0; 1: held already; 2: cannot."},
    {"original", original, METH_VARARGS, "Copy a held piece's original bytes into a writable buffer."},
    {"release", release, METH_VARARGS, "Give a held piece's pages back to the object store as they were."},
    {"held", held, METH_NOARGS, "Pieces held now."},
    {"copied", copied, METH_NOARGS, "Pieces this process copied on a first write."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_cow", "Copy-on-write pages of shared pieces.", -1,
                                    methods};

PyMODINIT_FUNC PyInit__cow(void) { return PyModule_Create(&module); }
