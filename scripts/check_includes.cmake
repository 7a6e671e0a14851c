# The include graph, checked by the build (target include_check, ckpt/CMakeLists.txt):
#  - ckpt/'s floors depend one way: util < pt < spec < store < shard. A file of
#    a floor includes headers of that floor and the floors below it only; a
#    unit test (*_test.cc) may also include ckpt/testing/. Above the floors,
#    ckpt/mpi/ and ckpt/testing/ may include any floor (and themselves); no
#    floor includes them. Nothing in ckpt/ includes another top-level folder.
#  - convert/ and tools/ never include libtrain/.
# Every violation is printed as "FILE: includes "HEADER": why"; any fails the build.
# Usage: cmake -DROOT=<source dir> -P check_includes.cmake
cmake_minimum_required(VERSION 3.25)
if(NOT ROOT)
  message(FATAL_ERROR "check_includes.cmake: pass -DROOT=<source dir>")
endif()

set(floors util pt spec store shard)
set(above_floors mpi testing)
set(top_level_folders ckpt convert tools libtrain migrate tests benchmarks)
set(violations "")

# The project headers `file` includes ("ckpt/pt/value.h", "libtrain/model.h"), in `out`.
function(project_includes file out)
  file(STRINGS "${ROOT}/${file}" lines REGEX "^[ \t]*#[ \t]*include[ \t]*[\"<][^\">]+[\">]")
  set(found "")
  foreach(line IN LISTS lines)
    string(REGEX REPLACE "^[ \t]*#[ \t]*include[ \t]*[\"<]([^\">]+)[\">].*$" "\\1" header "${line}")
    string(REGEX MATCH "^[^/]+" folder "${header}")
    if(folder IN_LIST top_level_folders)
      list(APPEND found "${header}")
    endif()
  endforeach()
  set(${out} "${found}" PARENT_SCOPE)
endfunction()

file(GLOB_RECURSE ckpt_files RELATIVE "${ROOT}" "${ROOT}/ckpt/*.h" "${ROOT}/ckpt/*.cc")
foreach(file IN LISTS ckpt_files)
  string(REGEX REPLACE "^ckpt/([^/]+)/.*$" "\\1" own "${file}")
  list(FIND floors "${own}" own_level)
  if(own_level GREATER_EQUAL 0)
    list(SUBLIST floors 0 ${own_level} allowed)
    list(APPEND allowed "${own}")
    if(file MATCHES "_test\\.cc$")
      list(APPEND allowed testing)
    endif()
  elseif(own IN_LIST above_floors)
    set(allowed ${floors} ${own})
  else()
    list(APPEND violations "${file}: ckpt/${own}/ is no floor; add it to the floors in scripts/check_includes.cmake and docs/design.md")
    continue()
  endif()
  list(TRANSFORM allowed PREPEND "ckpt/" OUTPUT_VARIABLE allowed_text)
  list(JOIN allowed_text "/, " allowed_text)
  project_includes("${file}" headers)
  foreach(header IN LISTS headers)
    if(NOT header MATCHES "^ckpt/([^/]+)/")
      list(APPEND violations "${file}: includes \"${header}\": ckpt/ includes nothing outside ckpt/")
      continue()
    endif()
    set(target "${CMAKE_MATCH_1}")
    if(NOT target IN_LIST allowed)
      list(APPEND violations "${file}: includes \"${header}\": ckpt/${own}/ may include only ${allowed_text}/")
    endif()
  endforeach()
endforeach()

file(GLOB_RECURSE product_files RELATIVE "${ROOT}" "${ROOT}/convert/*.h" "${ROOT}/convert/*.cc"
     "${ROOT}/tools/*.h" "${ROOT}/tools/*.cc")
foreach(file IN LISTS product_files)
  project_includes("${file}" headers)
  foreach(header IN LISTS headers)
    if(header MATCHES "^libtrain/")
      list(APPEND violations "${file}: includes \"${header}\": convert/ and tools/ never include libtrain/")
    endif()
  endforeach()
endforeach()

list(LENGTH ckpt_files ckpt_count)
list(LENGTH product_files product_count)
if(violations)
  list(JOIN violations "\n  " text)
  message(FATAL_ERROR "include check: includes against the floors (docs/design.md, \"Step 1: the floors\"):\n  ${text}")
endif()
message(STATUS "include check: ${ckpt_count} files of ckpt/ and ${product_count} of convert/ and tools/ include as the floors allow")
