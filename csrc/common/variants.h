// Helpers over the compiled-variant tables (attn_dist/variants.h,
// indexer/variants.h), which CMake generates from the ops' variants.py: the
// sets of values they cover, and the launchers' and handlers' messages that
// name those sets. Host code only.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <utility>

namespace attn_dist {

// A sorted set of at most N distinct ints, built at compile time.
template <size_t N>
struct IntSet {
  int values[N] = {};
  size_t size = 0;

  constexpr void insert(int v) {
    size_t i = 0;
    while (i < size && values[i] < v) ++i;
    if (i < size && values[i] == v) return;
    for (size_t j = size; j > i; --j) values[j] = values[j - 1];
    values[i] = v;
    ++size;
  }
  constexpr bool contains(int64_t v) const {
    for (size_t i = 0; i < size; ++i)
      if (values[i] == v) return true;
    return false;
  }
  constexpr const int* begin() const { return values; }
  constexpr const int* end() const { return values + size; }
};

// The distinct values of one field over a variant table, sorted.
template <class Variant, size_t N>
constexpr IntSet<N> FieldSet(const Variant (&table)[N], int Variant::*field) {
  IntSet<N> set;
  for (const Variant& v : table) set.insert(v.*field);
  return set;
}

// "512 or 576", "16, 32 or 64": a set's values in a message.
template <size_t N>
std::string OrList(const IntSet<N>& set) {
  std::string s;
  for (size_t i = 0; i < set.size; ++i) {
    if (i > 0) s += i + 1 == set.size ? " or " : ", ";
    s += std::to_string(set.values[i]);
  }
  return s;
}

// A launcher's `detail` built at run time: it stays valid on this thread until
// the next such message (the FFI handler copies it at once).
inline const char* KeepMessage(std::string text) {
  thread_local std::string kept;
  kept = std::move(text);
  return kept.c_str();
}

}  // namespace attn_dist
