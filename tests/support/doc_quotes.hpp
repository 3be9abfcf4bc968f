// The messages docs/ quotes, held to the code's own text. A test makes the code throw
// (or print) a message and calls check_doc_quote(doc, quote, message): the doc must
// contain `quote` word for word (however its lines are wrapped there), and the message
// must say what the quote says. In a quote, "..." and a placeholder in angle brackets
// (<path>, <kind>, <n>) stand for any text; everything else must appear in the message,
// in order. A doc edited without its test, or a message changed without its doc, fails.
#pragma once

#include <catch2/catch.hpp>

#include <cctype>
#include <fstream>
#include <iterator>
#include <stdexcept>
#include <string>
#include <vector>

#ifndef MPX_TEST_DOCS_DIR
#error "the build defines MPX_TEST_DOCS_DIR, the docs/ folder of the source tree"
#endif

namespace mpx_test {

//! Runs of whitespace (a line break where a doc wraps a quote) as one space.
inline std::string collapsed_whitespace(std::string const& text) {
  std::string out;
  for (char c : text) {
    bool const space = std::isspace(static_cast<unsigned char>(c)) != 0;
    if (space && (out.empty() || out.back() == ' ')) continue;
    out += space ? ' ' : c;
  }
  if (!out.empty() && out.back() == ' ') out.pop_back();
  return out;
}

inline std::string doc_text(std::string const& doc) {
  std::ifstream f(std::string(MPX_TEST_DOCS_DIR) + "/" + doc, std::ios::binary);
  if (!f) throw std::runtime_error("cannot read docs/" + doc);
  return collapsed_whitespace(std::string(std::istreambuf_iterator<char>(f), {}));
}

//! The fixed pieces of a quote: the text between its "..." and <placeholders>.
inline std::vector<std::string> quote_pieces(std::string const& quote) {
  std::vector<std::string> pieces(1);
  for (std::size_t i = 0; i < quote.size();) {
    bool wildcard = false;
    std::size_t skip = 0;
    if (quote.compare(i, 3, "...") == 0) {
      wildcard = true;
      skip = 3;
    } else if (quote[i] == '<' && i + 1 < quote.size() && std::islower(static_cast<unsigned char>(quote[i + 1]))) {
      std::size_t j = i + 1;
      while (j < quote.size() && (std::islower(static_cast<unsigned char>(quote[j])) || quote[j] == ' ' || quote[j] == '_'))
        ++j;
      if (j < quote.size() && quote[j] == '>') {
        wildcard = true;
        skip = j + 1 - i;
      }
    }
    if (wildcard) {
      pieces.emplace_back();
      i += skip;
    } else {
      pieces.back() += quote[i++];
    }
  }
  for (auto& p : pieces) {  // "again ..." and "... (at" elide the words, not the spaces
    while (!p.empty() && p.back() == ' ') p.pop_back();
    while (!p.empty() && p.front() == ' ') p.erase(p.begin());
  }
  return pieces;
}

//! Whether `message` says what `quote` says (see the top of this file).
inline bool message_matches_quote(std::string const& message, std::string const& quote) {
  std::string const m = collapsed_whitespace(message);
  std::size_t at = 0;
  for (auto const& piece : quote_pieces(collapsed_whitespace(quote))) {
    if (piece.empty()) continue;
    std::size_t const found = m.find(piece, at);
    if (found == std::string::npos) return false;
    at = found + piece.size();
  }
  return true;
}

inline void check_doc_quote(std::string const& doc, std::string const& quote, std::string const& message) {
  INFO("docs/" << doc << " quotes: " << quote << "\nthe code says: " << message);
  CHECK(doc_text(doc).find(collapsed_whitespace(quote)) != std::string::npos);
  CHECK(message_matches_quote(message, quote));
}

//! The what() of the mpx::error (or other std::exception) that f throws; fails the test
//! case when f throws nothing.
template <class F>
std::string message_of(F&& f) {
  try {
    f();
  } catch (std::exception const& e) {
    return e.what();
  }
  FAIL("expected an exception, none was thrown");
  return {};
}

}  // namespace mpx_test
