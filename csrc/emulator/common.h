// Shared pieces of the emulated device runtime: typed errors, bounded waits, small helpers.
#pragma once

#include <chrono>
#include <cmath>
#include <cstdint>
#include <sstream>
#include <stdexcept>
#include <string>
#include <thread>

namespace adp::emu {

// One C++ type per Python class in ascend_dualpath/errors.py; the bindings translate them.
enum class ErrorKind {
    kGeneric, kBounds, kAccess, kInvalidKey, kNotRegistered, kAlignment, kPayloadTooLarge,
    kCapacity, kConfig, kQueue, kProtocol, kTimeout,
};

class Error : public std::runtime_error {
   public:
    Error(ErrorKind kind, const std::string& msg) : std::runtime_error(msg), kind_(kind) {}
    ErrorKind kind() const { return kind_; }

   private:
    ErrorKind kind_;
};

template <typename... Args>
std::string cat(const Args&... args) {
    std::ostringstream os;
    (os << ... << args);
    return os.str();
}

template <typename... Args>
[[noreturn]] void fail(ErrorKind kind, const Args&... args) {
    throw Error(kind, cat(args...));
}

inline std::string hex(uint64_t v) {
    std::ostringstream os;
    os << "0x" << std::hex << v;
    return os.str();
}

using Clock = std::chrono::steady_clock;

// Every bound on a wait passes through here: NaN compares false with everything, so a NaN deadline
// would never expire, and infinity or a negative value is no bound at all.
inline void check_timeout(double timeout_s) {
    if (!(timeout_s >= 0.0) || !std::isfinite(timeout_s))
        fail(ErrorKind::kConfig, "timeout_s must be a finite number of seconds >= 0, got ", timeout_s);
}

// Spin-then-sleep waiting used by every poll loop: cheap when the answer comes fast, and gentle on a
// 2-core machine when it does not. `ready()` is polled until it returns true or `timeout_s` passes;
// returns false on timeout so the caller can raise an error that says what it waited for.
template <typename Pred>
bool wait_until(Pred&& ready, double timeout_s) {
    check_timeout(timeout_s);
    const auto deadline = Clock::now() + std::chrono::duration<double>(timeout_s);
    for (uint32_t spins = 0;; ++spins) {
        if (ready()) return true;
        if (spins < 256) continue;
        if (Clock::now() >= deadline) return ready();
        if (spins < 1024) std::this_thread::yield();
        else std::this_thread::sleep_for(std::chrono::microseconds(spins < 4096 ? 5 : 50));
    }
}

inline bool is_power_of_two(uint64_t v) { return v && !(v & (v - 1)); }
inline uint32_t log2_exact(uint64_t v) { return uint32_t(__builtin_ctzll(v)); }

}  // namespace adp::emu
