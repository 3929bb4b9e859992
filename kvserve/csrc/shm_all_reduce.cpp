// All-reduce over POSIX shared memory for the ranks of one TP group on one host.
//
// gloo over TCP on localhost costs ~100 syscalls and most of a millisecond of system CPU
// per rank for a 576-float all-reduce, and a decode step of a small model runs ~60 of
// them. Here each rank copies its tensor into its own slot of a segment every rank has
// mapped, publishes a sequence number, waits for every rank's, and sums the slots itself:
// no syscall at all when the ranks arrive together.
//
// Segment layout: one 128-byte line per rank holding its last published sequence number
// (a line each, and the neighbouring line too for the adjacent-line prefetcher, so a
// rank's store does not invalidate the line the others poll), then two banks of one slot
// per rank. Round s uses bank s % 2: a rank reaches round s + 2 only after every rank
// published s + 1, which each does after it finished reading round s, so a bank is never
// overwritten while someone still reads it and one barrier per round suffices. Tensors
// larger than a slot go in rounds of one slot each.
//
// Every rank sums the slots in rank order (float32 for 16-bit types, rounded once), so all
// ranks end with identical bits.

#include <fcntl.h>
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif
#include <sched.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <torch/custom_class.h>
#include <torch/library.h>
#include <unistd.h>

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cerrno>
#include <chrono>
#include <cstring>
#include <string>
#include <vector>

#include "cpu_common.h"

namespace kvserve_cpu {
namespace {

constexpr int64_t kFlagBytes = 128;
constexpr int64_t kAlign = 4096;

int64_t header_bytes(int64_t world) { return (world * kFlagBytes + kAlign - 1) / kAlign * kAlign; }

// Waiting, in three stages: spin with a pause while the peers are probably a few
// microseconds behind; then sched_yield, since with more ranks than cores (TP=3 on two in
// the tests) a spinning rank would hold the core a peer needs to arrive; then, once the
// wait is clearly long (a peer computing something the others do not), short sleeps, so
// a waiting rank does not burn a core it does not need.
constexpr int kSpins = 256;
constexpr double kYieldSeconds = 2e-3;
constexpr long kSleepNanos = 50'000;

template <typename T>
struct Accumulator {
  using type = float;
};
template <>
struct Accumulator<double> {
  using type = double;
};

}  // namespace

class ShmAllReduce : public torch::CustomClassHolder {
 public:
  // create: this rank makes the segment (O_EXCL: a name already taken is an error, not a
  // segment shared with strangers); the others open it by the name it sent them.
  ShmAllReduce(std::string name, bool create, int64_t rank, int64_t world, int64_t slot_bytes,
               double timeout_s)
      : name_(std::move(name)), rank_(rank), world_(world), slot_bytes_(slot_bytes),
        timeout_s_(timeout_s) {
    TORCH_CHECK(world >= 1 && rank >= 0 && rank < world, "ShmAllReduce: rank ", rank,
                " outside world ", world);
    TORCH_CHECK(slot_bytes >= 64 && slot_bytes % 64 == 0,
                "ShmAllReduce: slot_bytes must be a positive multiple of 64, got ", slot_bytes);
    TORCH_CHECK(timeout_s > 0, "ShmAllReduce: timeout_s must be positive");
    size_ = static_cast<size_t>(header_bytes(world) + 2 * world * slot_bytes);
    const int fd = create ? shm_open(name_.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600)
                          : shm_open(name_.c_str(), O_RDWR, 0600);
    TORCH_CHECK(fd >= 0, "ShmAllReduce: shm_open(", name_, ") failed: ", std::strerror(errno));
    if (create && ftruncate(fd, static_cast<off_t>(size_)) != 0) {
      const int err = errno;
      close(fd);
      shm_unlink(name_.c_str());
      TORCH_CHECK(false, "ShmAllReduce: ftruncate(", name_, ", ", size_,
                  ") failed: ", std::strerror(err));
    }
    struct stat info {};
    if (fstat(fd, &info) != 0 || static_cast<size_t>(info.st_size) != size_) {
      close(fd);
      TORCH_CHECK(false, "ShmAllReduce: segment ", name_, " is not ", size_, " bytes");
    }
    void* base = mmap(nullptr, size_, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    close(fd);  // the mapping keeps the segment alive
    TORCH_CHECK(base != MAP_FAILED, "ShmAllReduce: mmap(", name_, ") failed: ",
                std::strerror(errno));
    base_ = static_cast<char*>(base);
  }

  ~ShmAllReduce() override {
    if (base_ != nullptr) munmap(base_, size_);
  }

  // Removes the name once every rank mapped the segment: the memory goes away with the
  // last mapping, so nothing stays behind in /dev/shm when a process dies. Idempotent.
  void unlink() {
    if (!unlinked_) {
      unlinked_ = true;
      shm_unlink(name_.c_str());
    }
  }

  // Sums x over the ranks, in place. Every rank must call it in the same order with a
  // tensor of the same dtype and number of elements.
  void all_reduce(at::Tensor x) {
    TORCH_CHECK(x.device().is_cpu() && x.is_contiguous(),
                "ShmAllReduce: needs a contiguous CPU tensor");
    switch (x.scalar_type()) {
      case at::kFloat: return reduce<float>(x.data_ptr<float>(), x.numel());
      case at::kDouble: return reduce<double>(x.data_ptr<double>(), x.numel());
      case at::kBFloat16: return reduce<c10::BFloat16>(x.data_ptr<c10::BFloat16>(), x.numel());
      case at::kHalf: return reduce<c10::Half>(x.data_ptr<c10::Half>(), x.numel());
      default: TORCH_CHECK(false, "ShmAllReduce: unsupported dtype ", x.scalar_type());
    }
  }

  int64_t slot_bytes() const { return slot_bytes_; }

 private:
  uint64_t* flag(int64_t rank) const {
    return reinterpret_cast<uint64_t*>(base_ + rank * kFlagBytes);
  }
  char* slot(uint64_t round, int64_t rank) const {
    return base_ + header_bytes(world_) + ((round & 1) * world_ + rank) * slot_bytes_;
  }

  void wait_for_all(uint64_t round) const {
    using Clock = std::chrono::steady_clock;
    Clock::time_point start{};
    int64_t waits = 0;
    for (int64_t r = 0; r < world_; ++r) {
      while (__atomic_load_n(flag(r), __ATOMIC_ACQUIRE) < round) {
        ++waits;
        if (waits < kSpins) {
#if defined(__x86_64__) || defined(__i386__)
          _mm_pause();
#endif
          continue;
        }
        if (waits == kSpins) start = Clock::now();
        const double waited = std::chrono::duration<double>(Clock::now() - start).count();
        TORCH_CHECK(waited < timeout_s_, "shared-memory all-reduce: rank ", rank_,
                    " waited ", timeout_s_, " s for rank ", r, " of ", world_,
                    " (round ", round, "); the peer died or stopped taking part");
        if (waited < kYieldSeconds) {
          sched_yield();
        } else {
          const timespec pause{0, kSleepNanos};
          nanosleep(&pause, nullptr);
        }
      }
    }
  }

  template <typename T>
  void reduce(T* data, int64_t numel) {
    using Acc = typename Accumulator<T>::type;
    const int64_t per_round = slot_bytes_ / static_cast<int64_t>(sizeof(T));
    for (int64_t begin = 0; begin < numel; begin += per_round) {
      const int64_t n = std::min(per_round, numel - begin);
      T* out = data + begin;
      // Only this rank writes its flag: its last round is the one it last published.
      const uint64_t round = __atomic_load_n(flag(rank_), __ATOMIC_RELAXED) + 1;
      std::memcpy(slot(round, rank_), out, n * sizeof(T));
      __atomic_store_n(flag(rank_), round, __ATOMIC_RELEASE);
      wait_for_all(round);
      const T* first = reinterpret_cast<const T*>(slot(round, 0));
      if constexpr (std::is_same_v<T, Acc>) {
        std::memcpy(out, first, n * sizeof(T));
        for (int64_t r = 1; r < world_; ++r) {
          const T* in = reinterpret_cast<const T*>(slot(round, r));
          for (int64_t i = 0; i < n; ++i) out[i] += in[i];
        }
      } else {
        if (static_cast<int64_t>(scratch_.size()) < n) scratch_.resize(n);
        Acc* acc = scratch_.data();
        for (int64_t i = 0; i < n; ++i) acc[i] = static_cast<Acc>(first[i]);
        for (int64_t r = 1; r < world_; ++r) {
          const T* in = reinterpret_cast<const T*>(slot(round, r));
          for (int64_t i = 0; i < n; ++i) acc[i] += static_cast<Acc>(in[i]);
        }
        for (int64_t i = 0; i < n; ++i) out[i] = static_cast<T>(acc[i]);
      }
    }
  }

  std::string name_;
  int64_t rank_, world_, slot_bytes_;
  double timeout_s_;
  size_t size_ = 0;
  char* base_ = nullptr;
  bool unlinked_ = false;
  std::vector<float> scratch_;
};

}  // namespace kvserve_cpu

TORCH_LIBRARY_FRAGMENT(kvserve, m) {
  m.class_<kvserve_cpu::ShmAllReduce>("ShmAllReduce")
      .def(torch::init<std::string, bool, int64_t, int64_t, int64_t, double>())
      .def("unlink", &kvserve_cpu::ShmAllReduce::unlink)
      .def("all_reduce", &kvserve_cpu::ShmAllReduce::all_reduce)
      .def("slot_bytes", &kvserve_cpu::ShmAllReduce::slot_bytes);
}
