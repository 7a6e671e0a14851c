// ckpt-import IN.h5 DST --tp N --pp M ...: see tools/layout_cli.cc.
#include "tools/layout_cli.h"

int main(int argc, char** argv) { return tools::LayoutMain(argc, argv, tools::LayoutSource::kExport); }
