// Keeps the documentation true to the code: every ```cpp block of the given
// Markdown files must appear, line for line (indentation and blank lines
// aside), in one of the given source files, which the build compiles.
//
//   docs_snippets DOC.md... -- SOURCE...
#include <algorithm>
#include <cstdio>
#include <fstream>
#include <string>
#include <vector>

namespace {

std::string trim(const std::string& s) {
  const auto b = s.find_first_not_of(" \t\r");
  if (b == std::string::npos) return {};
  const auto e = s.find_last_not_of(" \t\r");
  return s.substr(b, e - b + 1);
}

std::vector<std::string> read_lines(const std::string& path, bool& ok) {
  std::ifstream in(path);
  ok = static_cast<bool>(in);
  std::vector<std::string> lines;
  for (std::string line; std::getline(in, line);) lines.push_back(line);
  return lines;
}

// The non-blank lines, trimmed.
std::vector<std::string> normalized(const std::vector<std::string>& lines) {
  std::vector<std::string> out;
  for (const auto& l : lines)
    if (auto t = trim(l); !t.empty()) out.push_back(t);
  return out;
}

}  // namespace

int main(int argc, char** argv) {
  std::vector<std::string> docs, sources;
  bool after_dashes = false;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg == "--") after_dashes = true;
    else (after_dashes ? sources : docs).push_back(arg);
  }
  std::vector<std::vector<std::string>> code;
  for (const auto& path : sources) {
    bool ok = false;
    code.push_back(normalized(read_lines(path, ok)));
    if (!ok) {
      std::fprintf(stderr, "cannot read source %s\n", path.c_str());
      return 2;
    }
  }
  int blocks = 0, missing = 0;
  for (const auto& path : docs) {
    bool ok = false;
    const auto lines = read_lines(path, ok);
    if (!ok) {
      std::fprintf(stderr, "cannot read doc %s\n", path.c_str());
      return 2;
    }
    for (std::size_t i = 0; i < lines.size(); ++i) {
      if (trim(lines[i]) != "```cpp") continue;
      const std::size_t start = i + 1;
      std::size_t end = start;
      while (end < lines.size() && trim(lines[end]) != "```") ++end;
      const auto block = normalized({lines.begin() + static_cast<long>(start), lines.begin() + static_cast<long>(end)});
      ++blocks;
      const bool found = std::any_of(code.begin(), code.end(), [&](const std::vector<std::string>& src) {
        return !block.empty() && std::search(src.begin(), src.end(), block.begin(), block.end()) != src.end();
      });
      if (!found) {
        ++missing;
        std::fprintf(stderr, "%s:%zu: this code block appears in none of the compiled sources\n", path.c_str(),
                     start);
      }
      i = end;
    }
  }
  std::printf("%d code blocks checked, %d not found in compiled sources\n", blocks, missing);
  return missing == 0 && blocks > 0 ? 0 : 1;
}
